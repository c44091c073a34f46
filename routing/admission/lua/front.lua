-- The first entries of a model's order (AdmissionQueue.front), renewing the calling frontend's
-- liveness mark and sweeping dead frontends' entries: one call per frontend per poll, however
-- many requests it has waiting. ARGV: 1 ns, 2 model, 3 frontend, 4 frontend ttl ms, 5 how many.
-- Reply: the members, first in line first.
local ns, model, wanted = ARGV[1], ARGV[2], tonumber(ARGV[5])
local now = now_ms()
renew_frontend(ns, ARGV[3], now, tonumber(ARGV[4]))
sweep_dead_frontends(ns, now)
local front = {}
for _, band in ipairs(redis.call('ZRANGE', ns .. BANDS_FAMILY .. model, 0, -1)) do
  if #front >= wanted then break end
  local members = redis.call('ZRANGE', band_key(ns, QUEUE_FAMILY, model, band), 0, wanted - #front - 1)
  for _, member in ipairs(members) do front[#front + 1] = member end
end
return front
