-- The sweep of expired load entries, after load_functions.lua; the router's decision script runs it
-- too, before it reads the load.
local SWEEP_BATCH = 256  -- expired entries released per sweep; the rest go at the next one

local function load_sweep(ns)
  local expired = redis.call('ZRANGEBYSCORE', ns .. EXPIRY_KEY, '-inf', server_time_ms(),
    'LIMIT', 0, SWEEP_BATCH)
  for _, member in ipairs(expired) do
    local cut = string.find(member, '\n', 1, true)
    release(ns, string.sub(member, 1, cut - 1), string.sub(member, cut + 1))
  end
  return #expired
end
