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
  -- Its predicted marks (kv_predict) that its approximate blocks lead to go too (those of an
  -- event-publishing worker lapse with the predicted TTL; a decision weighs only eligible names).
  local approximate = ns .. APPROXIMATE_FAMILY .. worker
  for _, h in ipairs(redis.call('ZRANGE', approximate, 0, -1)) do
    local mark = ns .. PREDICTED_FAMILY .. h
    local named = redis.call('GET', mark)
    if named and string.sub(named, 1, #worker + 1) == worker .. '\n' then redis.call('DEL', mark) end
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

-- Blocks the router sent to a worker. An approximate worker (one that publishes no events) is
-- credited with every block until now + ttl, in its `kv:approx:` sorted set: that is all the
-- router will ever know of its cache. For every worker, marks: each PREDICTED_STRIDE-th block and
-- the prompt's last name the worker for the same TTL (`kv:pred:`). They are what an
-- event-publishing worker is credited with until its own `stored` events arrive (a sibling sent
-- right after this prompt sees it cached there, to the last mark it shares), and what a decision
-- over a large fleet finds candidates by (kv_prefix_holders): a few SETs per decision instead of
-- a sorted-set entry per block.
local function kv_predict(ns, worker, packed, now, ttl, exact)
  local n = #packed / 8
  if exact then
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
  end
  -- A stride mark also carries the hashes of the blocks up to the next mark, so a sibling that
  -- leaves this prompt between two marks is credited to the exact block.
  local stride = tonumber(PREDICTED_STRIDE)
  for b = stride, n, stride do
    redis.call('SET', ns .. PREDICTED_FAMILY .. string.sub(packed, b * 8 - 7, b * 8),
      worker .. '\n' .. string.sub(packed, b * 8 + 1, math.min(b + stride - 1, n) * 8), 'PX', ttl)
  end
  if n > 0 and n % stride ~= 0 then
    redis.call('SET', ns .. PREDICTED_FAMILY .. string.sub(packed, n * 8 - 7, n * 8), worker .. '\n', 'PX', ttl)
  end
end

-- The marks kv_predict left on this request's blocks: {block, worker} pairs, deepest first. A
-- mark on block b says a prompt holding the request's first b blocks went to that worker
-- within the predicted TTL. One MGET of a few keys.
local function kv_predicted_marks(ns, packed)
  local n = #packed / 8
  local out = {}
  if n == 0 then return out end
  local stride = tonumber(PREDICTED_STRIDE)
  local at, keys = {}, {}
  if n % stride ~= 0 then at[1] = n end
  for b = n - n % stride, stride, -stride do at[#at + 1] = b end
  if #at == 0 then return out end
  for i = 1, #at do keys[i] = ns .. PREDICTED_FAMILY .. string.sub(packed, at[i] * 8 - 7, at[i] * 8) end
  local named = redis.call('MGET', unpack(keys))
  for i = 1, #at do
    local mark = named[i]
    if mark then
      local cut = string.find(mark, '\n', 1, true)
      local b = at[i]
      -- The blocks after the mark that the marked prompt shares with this one.
      local next_at = cut + 1
      while b < n and next_at + 7 <= #mark
        and string.sub(mark, next_at, next_at + 7) == string.sub(packed, b * 8 + 1, b * 8 + 8) do
        b, next_at = b + 1, next_at + 8
      end
      out[#out + 1] = {b, string.sub(mark, 1, cut - 1)}
    end
  end
  return out
end
