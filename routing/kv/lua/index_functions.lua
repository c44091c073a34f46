-- The index's functions (routing.kv.index): every write to `kv:blk:`, `kv:w:`, `kv:approx:` and
-- `kv:approximate` goes through them. Composed in front of the index's scripts, the event
-- publisher's and the router's decision, after the key names routing.kv.index gives them as
-- locals (BLOCK_FAMILY, WORKER_FAMILY, APPROXIMATE_FAMILY, APPROXIMATE_KEY): each is named once,
-- in Python.
local function kv_store(ns, worker, packed)
  local worker_key = ns .. WORKER_FAMILY .. worker
  for i = 1, #packed, 8 do
    local h = string.sub(packed, i, i + 7)
    redis.call('HSET', ns .. BLOCK_FAMILY .. h, worker, '1')
    redis.call('SADD', worker_key, h)
  end
end

local function kv_remove(ns, worker, packed)
  local worker_key = ns .. WORKER_FAMILY .. worker
  for i = 1, #packed, 8 do
    local h = string.sub(packed, i, i + 7)
    redis.call('HDEL', ns .. BLOCK_FAMILY .. h, worker)
    redis.call('SREM', worker_key, h)
  end
end

local function kv_purge(ns, worker)
  local worker_key = ns .. WORKER_FAMILY .. worker
  local held = redis.call('SMEMBERS', worker_key)
  for _, h in ipairs(held) do
    redis.call('HDEL', ns .. BLOCK_FAMILY .. h, worker)
  end
  -- Its predicted marks (kv_predict) go with its predicted blocks: a purged worker is no
  -- candidate (rare: only the marks among those blocks that still name it).
  local approximate = ns .. APPROXIMATE_FAMILY .. worker
  for _, h in ipairs(redis.call('ZRANGE', approximate, 0, -1)) do
    local mark = ns .. PREDICTED_FAMILY .. h
    if redis.call('GET', mark) == worker then redis.call('DEL', mark) end
  end
  redis.call('DEL', worker_key, approximate)
  redis.call('SREM', ns .. APPROXIMATE_KEY, worker)
  return #held
end

local function kv_apply(ns, kind, worker, packed)
  if kind == 'stored' then
    kv_store(ns, worker, packed)
  elseif kind == 'removed' then
    kv_remove(ns, worker, packed)
  elseif kind == 'cleared' then
    kv_purge(ns, worker)
  else
    return redis.error_reply('unknown kv event kind ' .. kind)
  end
end

local function server_time_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Blocks the router sent to a worker, credited to it until now + ttl (approximate mode, and
-- the predicted blocks of event-publishing workers until their own events arrive).
local function kv_predict(ns, worker, packed, now, ttl)
  local key = ns .. APPROXIMATE_FAMILY .. worker
  local expiry = now + ttl
  local args = {}
  for i = 1, #packed, 8 do
    args[#args + 1] = expiry
    args[#args + 1] = string.sub(packed, i, i + 7)
    if #args >= 1000 then
      redis.call('ZADD', key, unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call('ZADD', key, unpack(args)) end
  -- Expired entries go at every write and the key itself expires with its newest entry,
  -- so a worker the router stops using leaves nothing behind.
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  redis.call('SADD', ns .. APPROXIMATE_KEY, worker)
  -- Every PREDICTED_STRIDE-th block marks the worker for the same TTL: a decision that reads
  -- only candidates finds, by those marks, the worker that a sibling sharing this prefix was
  -- just sent to, before that worker's own events arrive (kv_prefix_holders).
  local stride = tonumber(PREDICTED_STRIDE)
  for b = stride, #packed / 8, stride do
    redis.call('SET', ns .. PREDICTED_FAMILY .. string.sub(packed, b * 8 - 7, b * 8), worker, 'PX', ttl)
  end
end
