-- LoadTracker.free_worker, after load_functions.lua.
-- ARGV: ns, worker -> how many requests were freed
local ids = redis.call('HKEYS', ARGV[1] .. REQUESTS_FAMILY .. ARGV[2])
for _, request_id in ipairs(ids) do release(ARGV[1], ARGV[2], request_id) end
return #ids
