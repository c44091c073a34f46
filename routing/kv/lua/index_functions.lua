-- The index's functions (routing.kv.index): every write to the index's key families goes through
-- them. Composed in front of the index's scripts, the event publisher's and the router's decision,
-- after the key names routing.kv.index gives them as locals (BUCKET_FAMILY, HOLDERS_FAMILY,
-- WORKER_FAMILY, ...): each is named once, in Python. The layout and why: routing.kv.index.

-- A block's bucket key and its field there: the hash's first two bytes pick one of 65,536 buckets,
-- its other six are the field.
local function kv_slot(ns, h)
  return ns .. BUCKET_FAMILY .. string.sub(h, 1, 2), string.sub(h, 3, 8)
end

-- Where worker `id` (2 bytes) sits in a holder string (1-based, at an odd place), or nil: a plain
-- find can match across two ids, so a match at an even place is passed over.
local function kv_id_at(holders, id)
  local from = 1
  while true do
    local at = string.find(holders, id, from, true)
    if not at or at % 2 == 1 then return at end
    from = at + 1
  end
end

-- The block's holder string ('' when nobody holds it), and whether it lives in a key of its own.
local function kv_holders(ns, h)
  local bucket, field = kv_slot(ns, h)
  local held = redis.call('HGET', bucket, field)
  if not held then return '', false end
  if held == PROMOTED then return redis.call('GET', ns .. HOLDERS_FAMILY .. h) or '', true end
  return held, false
end

-- How many workers hold the block, without reading a long holder string.
local function kv_holder_count(ns, h)
  -- HSTRLEN: the length alone, no string made in Lua; 1 is the PROMOTED mark (a holder string
  -- has an even length), 0 a block nobody holds.
  local length = redis.call('HSTRLEN', kv_slot(ns, h))
  if length == 1 then return redis.call('STRLEN', ns .. HOLDERS_FAMILY .. h) / 2 end
  return length / 2
end

-- Writes a block's holder string back where it belongs: inline up to INLINE_HOLDER_BYTES (so the
-- bucket stays a listpack), in its own string key past that, back inline once it has shrunk to
-- half (no flapping between the two at the boundary); nothing at all when it is empty.
local function kv_set_holders(ns, h, holders, own)
  local bucket, field = kv_slot(ns, h)
  local limit = tonumber(INLINE_HOLDER_BYTES)
  if #holders == 0 then
    redis.call('HDEL', bucket, field)
    if own then redis.call('DEL', ns .. HOLDERS_FAMILY .. h) end
  elseif #holders > limit or (own and #holders > limit / 2) then
    redis.call('SET', ns .. HOLDERS_FAMILY .. h, holders)
    if not own then redis.call('HSET', bucket, field, PROMOTED) end
  else
    redis.call('HSET', bucket, field, holders)
    if own then redis.call('DEL', ns .. HOLDERS_FAMILY .. h) end
  end
end

-- Worker `id` no longer holds block h; whether it did.
local function kv_drop(ns, h, id)
  local holders, own = kv_holders(ns, h)
  local at = kv_id_at(holders, id)
  if not at then return false end
  kv_set_holders(ns, h, string.sub(holders, 1, at - 1) .. string.sub(holders, at + 2), own)
  return true
end

-- A worker's 2-byte id ('' for none), given it on its first stored block: from the freed ids,
-- else the next unused one.
-- A field of both id maps that no name (names hold no newline) and no 2-byte id can be: its long
-- value keeps each map a hash table.
local TABLE_FIELD = '\n\n\n'

local function kv_worker_id(ns, worker, give)
  local id = redis.call('HGET', ns .. WORKER_IDS_KEY, worker)
  if id or not give then return id or '' end
  id = redis.call('SPOP', ns .. FREE_IDS_KEY)
  if not id then
    local n = redis.call('INCR', ns .. NEXT_ID_KEY)
    if n > 65535 then
      redis.call('DECR', ns .. NEXT_ID_KEY)
      return nil
    end
    -- Low byte first: a search for an id in a holder string (string.find, plain) scans for its
    -- first byte, and a fleet's high bytes are nearly all 0 to 3, so high byte first made it stop
    -- at every other byte (a 1,024-worker decision's candidates: 23 us of 153).
    id = struct.pack('<I2', n)
  end
  if redis.call('EXISTS', ns .. WORKER_IDS_KEY) == 0 then
    -- A new map starts as a hash table: a decision asks for every weighed worker's id (HMGET),
    -- and a listpack finds each by a linear scan (64 ids in 24 us, 10 as a table). A value
    -- longer than hash-max-listpack-value converts it for good; the field is of no id or name.
    local pad = string.rep('.', 1024)
    redis.call('HSET', ns .. WORKER_IDS_KEY, TABLE_FIELD, pad)
    redis.call('HSET', ns .. WORKER_NAMES_KEY, TABLE_FIELD, pad)
  end
  redis.call('HSET', ns .. WORKER_IDS_KEY, worker, id)
  redis.call('HSET', ns .. WORKER_NAMES_KEY, id, worker)
  return id
end

-- A worker that holds nothing leaves nothing: its log, its count and its id go (the id is free
-- for the next new worker: no holder string names it any more), and after the last worker the
-- id counter too.
local function kv_forget_worker(ns, worker, id)
  redis.call('DEL', ns .. WORKER_FAMILY .. worker)
  redis.call('HDEL', ns .. WORKER_COUNTS_KEY, worker)
  redis.call('HDEL', ns .. WORKER_IDS_KEY, worker)
  redis.call('HDEL', ns .. WORKER_NAMES_KEY, id)
  if redis.call('HLEN', ns .. WORKER_IDS_KEY) <= 1 then
    -- The last one (only TABLE_FIELD is left): ids start again from 1.
    redis.call('DEL', ns .. WORKER_IDS_KEY, ns .. WORKER_NAMES_KEY, ns .. FREE_IDS_KEY, ns .. NEXT_ID_KEY)
  else
    redis.call('SADD', ns .. FREE_IDS_KEY, id)
  end
end

-- The blocks of worker `id`'s log that it still holds, each once: the log less what it removed
-- since.
local function kv_log_held(ns, worker, id)
  local log = redis.call('GET', ns .. WORKER_FAMILY .. worker) or ''
  local seen, held = {}, {}
  for i = 1, #log, 8 do
    local h = string.sub(log, i, i + 7)
    if not seen[h] then
      seen[h] = true
      if kv_id_at((kv_holders(ns, h)), id) then held[#held + 1] = h end
    end
  end
  return held
end

-- The worker's log rewritten to the blocks it still holds, each once.
local function kv_compact(ns, worker, id)
  redis.call('SET', ns .. WORKER_FAMILY .. worker, table.concat(kv_log_held(ns, worker, id)))
end

local function kv_store(ns, worker, packed)
  local id = kv_worker_id(ns, worker, true)
  if not id then return redis.error_reply('the index holds 65535 workers: no id is left for ' .. worker) end
  local added = {}
  for i = 1, #packed, 8 do
    local h = string.sub(packed, i, i + 7)
    local holders, own = kv_holders(ns, h)
    if not kv_id_at(holders, id) then
      kv_set_holders(ns, h, holders .. id, own)
      added[#added + 1] = h
    end
  end
  if #added > 0 then
    local log_key = ns .. WORKER_FAMILY .. worker
    local length = redis.call('APPEND', log_key, table.concat(added)) / 8
    local count = redis.call('HINCRBY', ns .. WORKER_COUNTS_KEY, worker, #added)
    -- Removals leave their blocks in the log; rewriting it once it is half again the blocks
    -- held keeps it within that, at an amortized constant cost per stored block.
    if length > count + count / 2 + 64 then kv_compact(ns, worker, id) end
  end
end

local function kv_remove(ns, worker, packed)
  local id = kv_worker_id(ns, worker, false)
  if id == '' then return end
  local removed = 0
  for i = 1, #packed, 8 do
    if kv_drop(ns, string.sub(packed, i, i + 7), id) then removed = removed + 1 end
  end
  if removed > 0 and redis.call('HINCRBY', ns .. WORKER_COUNTS_KEY, worker, -removed) <= 0 then
    kv_forget_worker(ns, worker, id)
  end
end

local function kv_purge(ns, worker)
  local id = kv_worker_id(ns, worker, false)
  local held = 0
  if id ~= '' then
    local log = redis.call('GET', ns .. WORKER_FAMILY .. worker) or ''
    for i = 1, #log, 8 do
      if kv_drop(ns, string.sub(log, i, i + 7), id) then held = held + 1 end
    end
    kv_forget_worker(ns, worker, id)
  end
  -- Its predicted marks (kv_predict) that its approximate blocks lead to go too (those of an
  -- event-publishing worker lapse with the predicted TTL; a decision weighs only eligible names).
  local approximate = ns .. APPROXIMATE_FAMILY .. worker
  for _, h in ipairs(redis.call('ZRANGE', approximate, 0, -1)) do
    local mark = ns .. PREDICTED_FAMILY .. h
    local named = redis.call('GET', mark)
    if named and string.sub(named, 1, #worker + 1) == worker .. '\n' then redis.call('DEL', mark) end
  end
  redis.call('DEL', approximate)
  redis.call('SREM', ns .. APPROXIMATE_KEY, worker)
  return held
end

-- The event-backed blocks a worker holds, each once.
local function kv_worker_held(ns, worker)
  local id = kv_worker_id(ns, worker, false)
  if id == '' then return {} end
  return kv_log_held(ns, worker, id)
end

-- The values of `field`s of a hash, in order, a few thousand per HMGET (unpack's results are
-- bounded by Lua's C stack).
local function kv_hmget(key, fields)
  if #fields <= 4000 then
    if #fields == 0 then return {} end
    return redis.call('HMGET', key, unpack(fields))
  end
  local out = {}
  for from = 1, #fields, 4000 do
    local part = redis.call('HMGET', key, unpack(fields, from, math.min(from + 3999, #fields)))
    for k = 1, #part do out[#out + 1] = part[k] end
  end
  return out
end

local function kv_apply(ns, kind, worker, packed)
  if kind == 'stored' then
    return kv_store(ns, worker, packed)
  elseif kind == 'removed' then
    kv_remove(ns, worker, packed)
  elseif kind == 'cleared' then
    kv_purge(ns, worker)
  else
    return redis.error_reply('unknown kv event kind ' .. kind)
  end
end

-- Appends one event to the stream with the worker's next event id, which it returns.
local function kv_append_event(ns, maxlen, worker, payload)
  local event_id = redis.call('HINCRBY', ns .. EVENT_IDS_KEY, worker, 1)
  redis.call('XADD', ns .. EVENTS_STREAM, 'MAXLEN', '~', maxlen, '*',
    'worker', worker, 'event_id', event_id, 'event', payload)
  return event_id
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
      -- The blocks after the mark that the marked prompt shares with this one: usually all the
      -- mark carries (a repeat of its prompt), found by one comparison; block by block otherwise.
      local next_at = cut + 1
      local span = math.min(n - b, math.floor((#mark - cut) / 8))
      if span > 0 and string.sub(mark, next_at, next_at + span * 8 - 1)
          == string.sub(packed, b * 8 + 1, (b + span) * 8) then
        b = b + span
      else
        while b < n and next_at + 7 <= #mark
          and string.sub(mark, next_at, next_at + 7) == string.sub(packed, b * 8 + 1, b * 8 + 8) do
          b, next_at = b + 1, next_at + 8
        end
      end
      out[#out + 1] = {b, string.sub(mark, 1, cut - 1)}
    end
  end
  return out
end
