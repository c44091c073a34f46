-- KEYS: rpm bucket, active set. ARGV: rpm limit (0: none), max concurrent (0: none), request id,
-- slot ttl ms. Returns {0, 0, requests left, ms to full} admitted ({0, 0, -1, 0} without a
-- requests limit), or {1, wait ms} (requests), {2, wait ms} (concurrency).
local now = now_ms()
local rpm, max_active = tonumber(ARGV[1]), tonumber(ARGV[2])
local tokens = 0
if rpm > 0 then
  tokens = level(KEYS[1], rpm, now)
  if tokens < 1 then return {1, math.ceil((1 - tokens) * 60000 / rpm)} end
end
if max_active > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= max_active then
    return {2, 1000}
  end
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[3])
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[4]))
end
if rpm > 0 then
  take(KEYS[1], tokens, 1, now)
  local after = left(tokens - 1, rpm)
  return {0, 0, after[1], after[2]}
end
return {0, 0, -1, 0}
