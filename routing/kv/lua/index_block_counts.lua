-- KvIndex.block_counts, after index_functions.lua.
-- ARGV: ns, worker... -> per worker: event-backed blocks + unexpired approximate blocks
local now = server_time_ms()
local workers = {unpack(ARGV, 2)}
local counts = kv_hmget(ARGV[1] .. WORKER_COUNTS_KEY, workers)
local out = {}
for i = 1, #workers do
  out[i] = tonumber(counts[i] or 0)
    + redis.call('ZCOUNT', ARGV[1] .. APPROXIMATE_FAMILY .. workers[i], '(' .. now, '+inf')
end
return out
