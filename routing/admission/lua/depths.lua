-- What is queued, for metrics and the dashboard (AdmissionQueue.depths), after a sweep of dead
-- frontends' entries. ARGV: 1 ns. Reply: the depth hash, flat: "model\ttenant\tband", count ...
local ns = ARGV[1]
sweep_dead_frontends(ns, now_ms())
return redis.call('HGETALL', ns .. DEPTH_KEY)
