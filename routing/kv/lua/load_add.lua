-- LoadTracker.add, after load_functions.lua.
-- ARGV: ns, worker, request id, prefill tokens, blocks, ttl ms
local ns, worker, request_id = ARGV[1], ARGV[2], ARGV[3]
local prefill, blocks = tonumber(ARGV[4]), tonumber(ARGV[5])
release(ns, worker, request_id)  -- a re-add replaces, never double counts
redis.call('HSET', ns .. REQUESTS_FAMILY .. worker, request_id, prefill .. ' ' .. blocks)
adjust(ns, worker, prefill, blocks, 1)
redis.call('ZADD', ns .. EXPIRY_KEY, server_time_ms() + tonumber(ARGV[6]), worker .. '\n' .. request_id)
return 1
