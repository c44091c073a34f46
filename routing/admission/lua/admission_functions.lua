-- The admission queue's functions (routing.admission.queue): every write to its keys goes
-- through them. Composed in front of each of its scripts, after the key names the module gives
-- them as locals (QUEUE_FAMILY, BANDS_FAMILY, ENTRY_FAMILY, FINISH_FAMILY, DEPTH_KEY,
-- TENANT_DEPTH_KEY, TOTAL_KEY, FRONTENDS_KEY, FRONTEND_FAMILY, DRAINED_FAMILY, SEQUENCE_KEY).
--
-- A model's queue is one sorted set per priority band (`QUEUE_FAMILY<model>\n<band>`, member ->
-- start tag) and the set of its non-empty bands (`BANDS_FAMILY<model>`, band -> -priority, so
-- the highest band sorts first). Start-time fair queuing within a band: an entry's start tag is
-- max(the band's virtual time, its tenant's last finish tag), its finish tag start + 1/weight;
-- the band's virtual time is the start tag of the entry last dispatched (`FINISH_FAMILY<model>\n
-- <band>`: tenant -> last finish tag, field '' -> virtual time). Members begin with a zero-padded
-- arrival number, so equal tags leave in arrival order.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function band_key(ns, family, model, band)
  return ns .. family .. model .. '\n' .. band
end

local function depth_field(model, tenant, band)
  return model .. '\t' .. tenant .. '\t' .. band
end

-- A flow is a tenant's requests at one priority (llm-d's flows): its depth is bounded on its
-- own, so a tenant's flood of batch requests leaves room for its interactive ones.
local function flow_field(tenant, band)
  return tenant .. '\t' .. band
end

-- Takes an entry out of every structure; false if it was not queued. `dispatched`: it leaves
-- for a worker, so its band's virtual time moves to its start tag (a tenant that comes back
-- later starts behind what it already had); otherwise a tenant left with nothing queued in the
-- band forgets its finish tag (entries that never ran cost it no turn).
local function remove_entry(ns, member, dispatched)
  local entry = ns .. ENTRY_FAMILY .. member
  local e = redis.call('HMGET', entry, 'model', 'band', 'tenant', 'frontend')
  local model, band, tenant, frontend = e[1], e[2], e[3], e[4]
  if not model then return false end
  redis.call('DEL', entry)
  local queue = band_key(ns, QUEUE_FAMILY, model, band)
  local finish = band_key(ns, FINISH_FAMILY, model, band)
  if dispatched then
    local start = redis.call('ZSCORE', queue, member)
    if start then redis.call('HSET', finish, '', start) end
  end
  redis.call('ZREM', queue, member)
  redis.call('SREM', ns .. FRONTEND_FAMILY .. frontend, member)
  local left = redis.call('HINCRBY', ns .. DEPTH_KEY, depth_field(model, tenant, band), -1)
  if left <= 0 then
    redis.call('HDEL', ns .. DEPTH_KEY, depth_field(model, tenant, band))
    if not dispatched then redis.call('HDEL', finish, tenant) end
  end
  if redis.call('HINCRBY', ns .. TENANT_DEPTH_KEY, flow_field(tenant, band), -1) <= 0 then
    redis.call('HDEL', ns .. TENANT_DEPTH_KEY, flow_field(tenant, band))
  end
  if redis.call('DECR', ns .. TOTAL_KEY) <= 0 then redis.call('DEL', ns .. TOTAL_KEY) end
  if redis.call('ZCARD', queue) == 0 then
    -- An empty band starts its virtual time again from 0.
    redis.call('ZREM', ns .. BANDS_FAMILY .. model, band)
    redis.call('DEL', finish)
  end
  return true
end

-- The entries of frontends whose liveness mark lapsed (killed, partitioned) go: nobody would
-- ever dispatch them. A few frontends per call, so a call stays short.
local function sweep_dead_frontends(ns, now)
  local dead = redis.call('ZRANGEBYSCORE', ns .. FRONTENDS_KEY, '-inf', now, 'LIMIT', 0, 8)
  local removed = 0
  for _, frontend in ipairs(dead) do
    local members = redis.call('SMEMBERS', ns .. FRONTEND_FAMILY .. frontend)
    for _, member in ipairs(members) do
      if remove_entry(ns, member, false) then removed = removed + 1 end
    end
    redis.call('DEL', ns .. FRONTEND_FAMILY .. frontend)
    redis.call('ZREM', ns .. FRONTENDS_KEY, frontend)
  end
  return removed
end

local function renew_frontend(ns, frontend, now, ttl_ms)
  redis.call('ZADD', ns .. FRONTENDS_KEY, now + ttl_ms, frontend)
end

-- How many entries leave before `member`: every entry of the model's higher bands, and those
-- ahead of it in its own. nil when it is not queued.
local function ahead_of(ns, member)
  local e = redis.call('HMGET', ns .. ENTRY_FAMILY .. member, 'model', 'band')
  local model, band = e[1], e[2]
  if not model then return nil end
  local rank = redis.call('ZRANK', band_key(ns, QUEUE_FAMILY, model, band), member)
  if not rank then return nil end
  local bands = redis.call('ZRANGE', ns .. BANDS_FAMILY .. model, 0, -1)
  for _, other in ipairs(bands) do
    if other == band then break end
    rank = rank + redis.call('ZCARD', band_key(ns, QUEUE_FAMILY, model, other))
  end
  return rank
end

-- Dispatches of a model within the last `window_ms` (the drain rate's numerator).
local function drained(ns, model, now, window_ms)
  local key = ns .. DRAINED_FAMILY .. model
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window_ms)
  return redis.call('ZCARD', key)
end
