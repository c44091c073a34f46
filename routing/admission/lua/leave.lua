-- A request leaves the queue (AdmissionQueue.leave). ARGV: 1 ns, 2 member, 3 '1' when it leaves
-- for a worker ('0': it gave up, timed out or its client went away), 4 drain window ms.
-- Reply: 1 if it was queued, else 0; only the first of two calls for one member removes it.
local ns, member, dispatched = ARGV[1], ARGV[2], ARGV[3] == '1'
local model = redis.call('HGET', ns .. ENTRY_FAMILY .. member, 'model')
if not model then return 0 end
if dispatched then
  local now = now_ms()
  local key = ns .. DRAINED_FAMILY .. model
  redis.call('ZADD', key, now, member)
  redis.call('PEXPIRE', key, tonumber(ARGV[4]))
  drained(ns, model, now, tonumber(ARGV[4]))
end
remove_entry(ns, member, dispatched)
return 1
