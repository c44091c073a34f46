-- KvIndex.purge_worker, after index_functions.lua. ARGV: ns, worker -> blocks dropped
-- A worker that held blocks is announced as `cleared` on the event stream, as if it had said so
-- itself, so the replicas of the index (routing.kv.replica) drop it too.
local ns, worker = ARGV[1], ARGV[2]
local held_any = redis.call('HEXISTS', ns .. WORKER_IDS_KEY, worker) == 1
local dropped = kv_purge(ns, worker)
if held_any then
  kv_append_event(ns, STREAM_MAXLEN, worker, cjson.encode({kind = 'cleared', worker = worker,
    parent_hash = cjson.null}))
end
return dropped
