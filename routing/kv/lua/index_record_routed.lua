-- KvIndex.record_routed, after index_functions.lua.
-- ARGV: ns, worker, ttl_ms, packed hashes
kv_predict(ARGV[1], ARGV[2], ARGV[4], server_time_ms(), tonumber(ARGV[3]), true)
return 0
