-- Where a queued request stands (AdmissionQueue.turn), renewing its frontend's liveness mark.
-- ARGV: 1 ns, 2 member, 3 frontend, 4 frontend ttl ms. Reply: entries ahead of it (0: its turn),
-- or -1 when it is no longer queued (its frontend was taken for dead).
local ns, member = ARGV[1], ARGV[2]
local now = now_ms()
-- Renewed first: a frontend that polls is alive, however late its poll.
renew_frontend(ns, ARGV[3], now, tonumber(ARGV[4]))
sweep_dead_frontends(ns, now)
local ahead = ahead_of(ns, member)
if ahead == nil then return -1 end
return ahead
