-- KvIndex.block_counts, after index_functions.lua.
-- ARGV: ns, worker... -> per worker: event-backed blocks + unexpired approximate blocks
local now = server_time_ms()
local out = {}
for i = 2, #ARGV do
  out[#out + 1] = redis.call('SCARD', ARGV[1] .. WORKER_FAMILY .. ARGV[i])
    + redis.call('ZCOUNT', ARGV[1] .. APPROXIMATE_FAMILY .. ARGV[i], '(' .. now, '+inf')
end
return out
