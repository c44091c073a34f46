-- The load tracker's functions (routing.kv.load): every write to `load:req:`, `load:totals` and
-- `load:expiry` goes through them. Composed in front of the tracker's scripts and the router's
-- decision, after the key names routing.kv.load gives them as locals (REQUESTS_FAMILY, TOTALS_KEY,
-- EXPIRY_KEY): each is named once, in Python.
local function server_time_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A worker's field of load:totals: prefill tokens, blocks, requests, drained at (ms), as
-- Python's `_TOTALS`. Whatever reads or writes the field (the router's decision script too)
-- uses this format.
local TOTALS_FORMAT = '>i8i8i8i8'

local function totals_of(ns, worker)
  local raw = redis.call('HGET', ns .. TOTALS_KEY, worker)
  if not raw then return 0, 0, 0, 0 end
  local prefill, blocks, requests, drained_at = struct.unpack(TOTALS_FORMAT, raw)
  return prefill, blocks, requests, drained_at
end

-- Adds to a worker's sums; `drained_at` (nil: kept) replaces its drain estimate, which goes
-- when nothing reserved is left to drain. The field goes with the worker's last request.
local function adjust(ns, worker, prefill, blocks, requests, drained_at)
  local p, b, r, d = totals_of(ns, worker)
  p, b, r = p + prefill, b + blocks, r + requests
  if r <= 0 then
    redis.call('HDEL', ns .. TOTALS_KEY, worker)
    return
  end
  if drained_at then d = drained_at end
  if p <= 0 then d = 0 end
  redis.call('HSET', ns .. TOTALS_KEY, worker, struct.pack(TOTALS_FORMAT, p, b, r, d))
end

local function entry_of(ns, worker, request_id)
  local raw = redis.call('HGET', ns .. REQUESTS_FAMILY .. worker, request_id)
  if not raw then return nil end
  local space = string.find(raw, ' ', 1, true)
  return tonumber(string.sub(raw, 1, space - 1)), tonumber(string.sub(raw, space + 1))
end

local function release(ns, worker, request_id)
  redis.call('ZREM', ns .. EXPIRY_KEY, worker .. '\n' .. request_id)
  local prefill, blocks = entry_of(ns, worker, request_id)
  if not prefill then return 0 end
  redis.call('HDEL', ns .. REQUESTS_FAMILY .. worker, request_id)
  if redis.call('EXISTS', ns .. REQUESTS_FAMILY .. worker) == 0 then
    -- The worker's last request: nothing is in flight there, whatever its sums say. A sum that
    -- drifted (a process of an older layout freed an entry without it) heals here.
    redis.call('HDEL', ns .. TOTALS_KEY, worker)
  else
    adjust(ns, worker, -prefill, -blocks, -1)
  end
  return 1
end
