-- KvIndex.snapshot, after index_functions.lua.
-- ARGV: ns, worker -> {its last event id (0: none), the blocks it holds, packed}
local ns, worker = ARGV[1], ARGV[2]
local event_id = redis.call('HGET', ns .. EVENT_IDS_KEY, worker) or 0
return {tonumber(event_id), table.concat(kv_worker_held(ns, worker))}
