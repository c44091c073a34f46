-- KvIndex.worker_blocks, after index_functions.lua.
-- ARGV: ns, worker -> {event-backed blocks, unexpired approximate blocks}
local now = server_time_ms()
return {
  kv_worker_held(ARGV[1], ARGV[2]),
  redis.call('ZRANGEBYSCORE', ARGV[1] .. APPROXIMATE_FAMILY .. ARGV[2], '(' .. now, '+inf'),
}
