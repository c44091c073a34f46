-- LoadTracker.free, after load_functions.lua. ARGV: ns, worker, request id -> 1 if it was tracked
return release(ARGV[1], ARGV[2], ARGV[3])
