-- LoadTracker.prefill_done, after load_functions.lua.
-- ARGV: ns, worker, request id, ttl ms
local ns, worker, request_id = ARGV[1], ARGV[2], ARGV[3]
local prefill, blocks = entry_of(ns, worker, request_id)
if not prefill then return 0 end
if prefill > 0 then
  redis.call('HSET', ns .. REQUESTS_FAMILY .. worker, request_id, '0 ' .. blocks)
  adjust(ns, worker, -prefill, 0, 0)
end
-- Decoding has begun: the request is alive, so its expiry starts again.
local member = worker .. '\n' .. request_id
redis.call('ZADD', ns .. EXPIRY_KEY, 'XX', server_time_ms() + tonumber(ARGV[4]), member)
return 1
