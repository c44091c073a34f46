-- MediaStore.put (routing.media.store): sweep what expired, check both caps, store the blob.
-- KEYS: blob, owner, sizes, total. ARGV: blob bytes, size, ttl ms, now ms, per-owner cap, total cap.
-- Returns {0, total} when stored, {1, owner bytes} over the per-owner cap, {2, total} over the total.
local now = tonumber(ARGV[4])
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
if #expired > 0 then
  local freed = 0
  for _, member in ipairs(expired) do
    freed = freed + tonumber(string.match(member, '|(%d+)$'))
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  local left = redis.call('DECRBY', KEYS[4], freed)
  if left < 0 then redis.call('SET', KEYS[4], 0) end
end
local size = tonumber(ARGV[2])
local owner = tonumber(redis.call('GET', KEYS[2]) or '0')
if owner + size > tonumber(ARGV[5]) then return {1, owner} end
local total = tonumber(redis.call('GET', KEYS[4]) or '0')
if total + size > tonumber(ARGV[6]) then return {2, total} end
local ttl = tonumber(ARGV[3])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('INCRBY', KEYS[2], size)
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('ZADD', KEYS[3], now + ttl, KEYS[1] .. '|' .. size)
redis.call('INCRBY', KEYS[4], size)
return {0, total + size}
