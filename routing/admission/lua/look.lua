-- What a new request of a model would find (AdmissionQueue.full_for), without a sweep: one
-- round trip from a thread or an event loop. ARGV: 1 ns, 2 model, 3 "tenant\tband" (the flow).
-- Reply: {the flow's depth, the queue's total, the model's dispatches in the drain window}.
local ns, model = ARGV[1], ARGV[2]
return {
  tonumber(redis.call('HGET', ns .. TENANT_DEPTH_KEY, ARGV[3]) or 0),
  tonumber(redis.call('GET', ns .. TOTAL_KEY) or 0),
  redis.call('ZCARD', ns .. DRAINED_FAMILY .. model),
}
