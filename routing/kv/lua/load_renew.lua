-- LoadTracker.renew, after load_functions.lua.
-- ARGV: ns, worker, request id, ttl ms -> 1 if the entry is still tracked
return redis.call('ZADD', ARGV[1] .. EXPIRY_KEY, 'XX', 'CH', server_time_ms() + tonumber(ARGV[4]),
  ARGV[2] .. '\n' .. ARGV[3])
