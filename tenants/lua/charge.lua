-- KEYS: tpm bucket. ARGV: limit, cost. Returns {0, 0, tokens left, ms to full} charged,
-- {1, wait ms}, or {3, 0} never fits.
local now = now_ms()
local limit, cost = tonumber(ARGV[1]), tonumber(ARGV[2])
if cost > limit then return {3, 0} end
local tokens = level(KEYS[1], limit, now)
if tokens < cost then return {1, math.ceil((cost - tokens) * 60000 / limit)} end
take(KEYS[1], tokens, cost, now)
local after = left(tokens - cost, limit)
return {0, 0, after[1], after[2]}
