-- The token buckets' functions, composed in front of admit.lua and charge.lua.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- tokens left in a bucket of `limit` per minute at `now`, without taking any
local function level(key, limit, now)
  local state = redis.call('HMGET', key, 't', 'ts')
  local tokens = tonumber(state[1]) or limit
  local ts = tonumber(state[2]) or now
  return math.min(limit, tokens + (now - ts) * limit / 60000)
end
local function take(key, tokens, cost, now)
  redis.call('HSET', key, 't', tokens - cost, 'ts', now)
  redis.call('PEXPIRE', key, 120000)
end
-- what is left of a bucket after a take, and the ms until it is full again (OpenAI's "reset")
local function left(tokens, limit)
  return {math.floor(tokens), math.ceil((limit - tokens) * 60000 / limit)}
end
