-- Queue a request (AdmissionQueue.join). ARGV: 1 ns, 2 model, 3 band (priority, an integer),
-- 4 tenant, 5 frontend, 6 request id, 7 weight (> 0; 0: arrival order, no fair share),
-- 8 max total depth, 9 max depth per tenant, 10 frontend ttl ms, 11 drain window ms.
-- Reply: {1, member, ahead, drained in the window} or {0, cause, depth ahead, drained}, cause
-- 'tenant' (the tenant's requests at this priority, its flow) or 'total'.
local ns, model, band, tenant, frontend = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local weight = tonumber(ARGV[7])
local now = now_ms()
renew_frontend(ns, frontend, now, tonumber(ARGV[10]))
sweep_dead_frontends(ns, now)
local total = tonumber(redis.call('GET', ns .. TOTAL_KEY)) or 0
local mine = tonumber(redis.call('HGET', ns .. TENANT_DEPTH_KEY, flow_field(tenant, band))) or 0
local rate = drained(ns, model, now, tonumber(ARGV[11]))
if mine >= tonumber(ARGV[9]) then return {0, 'tenant', total, rate} end
if total >= tonumber(ARGV[8]) then return {0, 'total', total, rate} end
local member = string.format('%016d', redis.call('INCR', ns .. SEQUENCE_KEY)) .. ':' .. ARGV[6]
local finish = band_key(ns, FINISH_FAMILY, model, band)
local start = 0
if weight > 0 then
  local virtual = tonumber(redis.call('HGET', finish, '')) or 0
  start = math.max(virtual, tonumber(redis.call('HGET', finish, tenant)) or virtual)
  redis.call('HSET', finish, tenant, tostring(start + 1 / weight))
end
redis.call('ZADD', band_key(ns, QUEUE_FAMILY, model, band), start, member)
redis.call('ZADD', ns .. BANDS_FAMILY .. model, -tonumber(band), band)
redis.call('HSET', ns .. ENTRY_FAMILY .. member, 'model', model, 'band', band, 'tenant', tenant,
  'frontend', frontend)
redis.call('SADD', ns .. FRONTEND_FAMILY .. frontend, member)
redis.call('HINCRBY', ns .. DEPTH_KEY, depth_field(model, tenant, band), 1)
redis.call('HINCRBY', ns .. TENANT_DEPTH_KEY, flow_field(tenant, band), 1)
redis.call('INCR', ns .. TOTAL_KEY)
return {1, member, ahead_of(ns, member), rate}
