-- KvRouter's decision (routing.kv.router), one round trip: after index_functions.lua,
-- overlaps_functions.lua, the line that makes `kv_overlaps` the index's variant, load_functions.lua
-- and sweep_functions.lua, so each key family is still read and written by the functions of the
-- module that owns it (kv_predict, adjust, release, load_sweep ...).
-- ARGV:  1 ns, 2 packed block hashes, 3 affinity key or '', 4 request id ('' = decide only),
--  5 isl, 6 block size, 7 overlap credit, 8 prefill load scale, 9 temperature,
-- 10 affinity cost slack, 11 affinity max overlap lead (blocks), 12 busy max requests (0 off),
-- 13 busy kv fraction (0 off), 14 mode, 15 uniform random in [0, 1), 16 load entry ttl ms,
-- 17 predicted ttl ms (0 off), 18 approximate ttl ms, 19 affinity ttl ms, 20 rr key,
-- 21 what the busy check reads of the workers that report it ('' while both thresholds are
-- off), four big-endian i32s each: index, kv capacity blocks, reported running + waiting (-1:
-- none), reported kv blocks in use (-1: none). 22 the worker names, distinct, joined by
-- newlines (which no name holds): one argument instead of one per worker saves the client more
-- time than splitting it here costs the script. 23 load bound gap (requests; 0 off), 24 load
-- bound ratio, 25 each worker's measured prefill rate in tokens/s, one big-endian double per
-- worker in order, as the heartbeat said it (0: none; '' when nothing drains), 26 the
-- approximate workers' indexes, one i32 each. 27 one byte per worker in order, '1' where its
-- engine schedules prompts shortest first (the load bound's queue condition then charges a
-- prompt only what it would wait for there), '0' where it computes them in arrival order.
-- 28, 29: a key and the value it must hold for the script to do anything ('' for none): the
-- frontend's read of its workers was made under that generation of the rows; a reply of false,
-- 'stale' when it moved (nothing read, nothing reserved).
-- 30, 31, 32: a large fleet's decision among candidates ('' in 30 for a decision over the
-- workers of 22): 30 the key of the fleet read's facts (KvRouter._write_facts: each
-- eligible worker's record, FACTS_FORMAT: kv capacity, running + waiting (-1: none), kv in use
-- (-1: none), prefill rate, schedule byte, 1 if approximate; one string of them, at the places
-- the hash at 35 gives by name), 31 the holders drawn per prefix
-- length, 32 the workers drawn for load, joined by newlines. The candidates are read here
-- (kv_candidate_overlaps) and only those the facts name (the eligible ones) are weighed; 21,
-- 22 and 25 to 27 are ''. A reply of false, 'nofleet' when the facts are gone (nothing read,
-- nothing reserved); 'noplaces' when their places are gone (the facts may be too).
-- 33, 34: candidates the frontend found in its replica of the index (routing.kv.replica; '' in
-- 33 otherwise): 32 their names, joined by newlines, 33 their overlaps, one big-endian i32 each,
-- 34 their facts, FACTS_FORMAT each, in order. 35: the key of the facts' places (1 onwards) by
-- name, for a decision among candidates. The script adds the workers the predicted marks
-- name and the session's worker (their facts from 30, their overlaps from the marks and the
-- index) and raises the approximate workers' overlaps; nothing of the index is walked.
-- 36: '1' for the chosen worker's figures alone (a request being dispatched: see the reply).
-- 37: a key whose existence means requests wait ahead of this one (the admission queue's bands
-- of the model: '' or absent for none): a reply of false, 'waiting' when it exists (nothing
-- read, nothing reserved), so that the look and the decision are one round trip and one step.
-- The reply: the chosen worker's place among those weighed (false: none), the reason, the best
-- overlap, the overlap, prefill and decode columns, the busy places, and, among candidates,
-- the names of those weighed (an empty list otherwise). With 36 at '1', as if the chosen worker
-- and the busy ones had been all those weighed: their names always, the chosen first (place 1),
-- and its figures alone in the columns. Every candidate's columns and names are what only
-- `/v1/route` and the debug log read, and building and sending them took about 7% of a
-- decision's time in Redis (bench/decision_script.py).
-- Binary strings: far cheaper to send than arguments per worker, and to build and read than
-- text; and only what the policy reads is sent.
if ARGV[28] ~= '' and redis.call('GET', ARGV[28]) ~= ARGV[29] then
  return {false, 'stale', 0, '', '', '', {}, {}}
end
if ARGV[37] and ARGV[37] ~= '' and redis.call('EXISTS', ARGV[37]) == 1 then
  return {false, 'waiting', 0, '', '', '', {}, {}}
end
local ns, packed = ARGV[1], ARGV[2]
local isl, bs = tonumber(ARGV[5]), tonumber(ARGV[6])
local credit, scale, temperature = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local slack, lead = tonumber(ARGV[10]), tonumber(ARGV[11])
local max_requests, max_kv = tonumber(ARGV[12]), tonumber(ARGV[13])
local mode, u = ARGV[14], tonumber(ARGV[15])
local gap = mode == 'kv' and tonumber(ARGV[23]) or 0
local ratio = tonumber(ARGV[24])
-- Globals cost a table lookup each in Redis's Lua, and the per-worker passes below call these
-- hundreds of times per decision: locals make the load reads about a third cheaper.
local tonumber, max = tonumber, math.max
-- Per-worker facts stay nil for the workers that have none (the common case): defaults at use.
local n, names, position, prefill, decode, requests = 0, {}, {}, {}, {}, {}
local approximate, capacity, rep_requests, rep_kv, rate = {}, {}, {}, {}, {}
local draining = false
local i32 = 2147483647
local reported, rates, approximate_at, schedules = ARGV[21], ARGV[25], ARGV[26], ARGV[27]
local overlaps
-- A measured prefill rate in whole tokens/s up to an i32's worth; nil for what is not a rate of
-- one token/s or more (0 for none, NaN), which drains nothing. Python sends the rates as they
-- are: converting them there cost more per decision than doing it here.
local function whole_rate(r)
  if r >= 1 then return r < i32 and math.floor(r) or i32 end
  return nil
end
local sticky_read = nil  -- the affinity key's worker, once read
local among = ARGV[30] ~= ''
-- The records of `names` in the fleet read's facts, by their places: false for a name the facts
-- leave out (not eligible). Each record is read where it lies (GETRANGE, ~0.8 us a record here),
-- never the whole string: that holds a record per eligible worker, and its GET into Lua grew with
-- the fleet (~35 us at 1,024 workers, 22 kB), more than 34 candidates' GETRANGEs cost.
local function fleet_records(names)
  local places, out = kv_hmget(ARGV[35], names), {}
  local size = struct.size(FACTS_FORMAT)
  for k = 1, #names do
    local place = places[k]
    if place then
      local at = (tonumber(place) - 1) * size
      out[k] = redis.call('GETRANGE', ARGV[30], at, at + size - 1)
    else
      out[k] = false
    end
  end
  return out
end
if among then
  -- The facts and their places are written in one transaction; the places outlive the facts
  -- they serve (a router renews them with every facts it writes), and either may be gone.
  local places_gone = redis.call('EXISTS', ARGV[35]) == 0
  if places_gone or redis.call('EXISTS', ARGV[30]) == 0 then
    return {false, places_gone and 'noplaces' or 'nofleet', 0, '', '', '', {}, {}}
  end
  if ARGV[3] ~= '' then sticky_read = redis.call('GET', ARGV[3]) or false end
  local names_given = {}  -- the sampled names, or the given candidates
  for name in string.gmatch(ARGV[32], '[^\n]+') do names_given[#names_given + 1] = name end
  local found, found_overlaps, records
  if ARGV[33] ~= '' then
    found, found_overlaps, records = names_given, {}, {}
    local given, size = ARGV[33], struct.size(FACTS_FORMAT)
    for at = 1, #given, 4000 do  -- a thousand per unpack (Lua's C stack bounds its results)
      local chunk = string.sub(given, at, at + 3999)
      local values = {struct.unpack('>' .. string.rep('i4', #chunk / 4), chunk)}
      local offset = (at - 1) / 4
      for k = 1, #chunk / 4 do found_overlaps[offset + k] = values[k] end
    end
    -- A given candidate's record is where it starts in ARGV[34] (read in place: no copy of it).
    for k = 1, #found do records[k] = (k - 1) * size + 1 end
    local at, extra = {}, {}
    for k = 1, #found do at[found[k]] = k end
    local function join(name, o)
      local k = at[name]
      if k then
        if found_overlaps[k] < o then found_overlaps[k] = o end
      else
        k = #found + 1
        found[k], found_overlaps[k], at[name] = name, o, k
        extra[#extra + 1] = name
      end
    end
    for _, mark in ipairs(kv_predicted_marks(ns, packed)) do join(mark[2], mark[1]) end
    if sticky_read and not at[sticky_read] then
      join(sticky_read, kv_worker_overlap(ns, packed, sticky_read))
    end
    if #extra > 0 then  -- their facts, where they are eligible
      local got = fleet_records(extra)
      for i = 1, #extra do records[at[extra[i]]] = got[i] end
    end
    kv_approximate_overlaps(ns, packed, found, found_overlaps)
  else
    local sample = names_given
    if sticky_read then sample[#sample + 1] = sticky_read end
    found, found_overlaps = kv_candidate_overlaps(ns, packed, tonumber(ARGV[31]), sample)
    records = fleet_records(found)
  end
  local unpack_record, flags, given_facts = struct.unpack, {}, ARGV[34]
  overlaps = {}
  for k = 1, #found do
    local record = records[k]
    if record then  -- an eligible worker: weighed
      local name = found[k]
      local cap, req, kv, r, schedule, approx
      if type(record) == 'number' then
        cap, req, kv, r, schedule, approx = unpack_record(FACTS_FORMAT, given_facts, record)
      else
        cap, req, kv, r, schedule, approx = unpack_record(FACTS_FORMAT, record)
      end
      n = n + 1
      names[n], position[name], prefill[n], decode[n], requests[n] = name, n, 0, 0, 0
      overlaps[n], flags[n] = found_overlaps[k], schedule
      capacity[n], rep_requests[n], rep_kv[n] = cap, req, kv
      r = whole_rate(r)
      if r then rate[n], draining = r, true end
      if approx == 1 then approximate[n] = true end
    end
  end
  local parts = {}
  for i = 1, n, 1000 do parts[#parts + 1] = string.char(unpack(flags, i, math.min(i + 999, n))) end
  schedules = table.concat(parts)
else
  for name in string.gmatch(ARGV[22], '[^\n]+') do
    n = n + 1
    names[n], position[name], prefill[n], decode[n], requests[n] = name, n, 0, 0, 0
  end
  for at = 1, #reported, 16 do
    local j, cap, req, kv = struct.unpack('>i4i4i4i4', reported, at)
    capacity[j], rep_requests[j], rep_kv[j] = cap, req, kv
  end
  -- A thousand rates per unpack (its results are bounded by Lua's C stack).
  for at = 1, #rates, 8000 do
    local chunk = string.sub(rates, at, at + 7999)
    local values = {struct.unpack('>' .. string.rep('d', #chunk / 8), chunk)}
    local offset = (at - 1) / 8
    for k = 1, #chunk / 8 do
      local r = whole_rate(values[k])
      if r then rate[offset + k], draining = r, true end
    end
  end
  for at = 1, #approximate_at, 4 do approximate[struct.unpack('>i4', approximate_at, at)] = true end
end

load_sweep(ns)
if not overlaps then  -- (among candidates, read with them above)
  overlaps = kv_overlaps(ns, packed, names, position)
end
-- Each worker's running sums (routing.kv.load, `load:totals`), read whole: HMGET would scan the
-- small listpack once per asked worker. Idle workers have no field: 0 everywhere.
local done_at = {}
-- Unless many more workers have load than are weighed here (candidates of a large fleet): then
-- theirs alone, so the cost follows the candidates, not the fleet's load.
do
  local unpack_totals = struct.unpack
  local function take(j, raw)
    local p, b, r, d = unpack_totals(TOTALS_FORMAT, raw)
    prefill[j], decode[j], requests[j] = p, b, r
    if d > 0 then done_at[j] = d end
  end
  if redis.call('HLEN', ns .. TOTALS_KEY) > 4 * n then
    local raw = redis.call('HMGET', ns .. TOTALS_KEY, unpack(names))
    for j = 1, n do
      if raw[j] then take(j, raw[j]) end
    end
  else
    local flat = redis.call('HGETALL', ns .. TOTALS_KEY)
    for i = 1, #flat, 2 do
      local j = position[flat[i]]
      if j then take(j, flat[i + 1]) end
    end
  end
end
-- Prefill drain: a worker works through the prompts reserved on it from the moment they arrive,
-- at the rate its engine measures, so a prompt reserved 200 ms ago weighs less than one reserved
-- just now. Each worker's totals hold when its reserved prefill should be done if it drains at
-- that rate (Redis time, ms); what it estimates is left is never more than what is still
-- reserved, and the estimate goes when the worker's reserved prefill reaches 0 (the load
-- tracker's `adjust`). A worker with no rate or no estimate counts its reservations in full.
-- Only the workers with an estimate drain: usually few, so the pass goes over them alone.
local now = nil
if draining and next(done_at) ~= nil then
  now = server_time_ms()
  for j, d in pairs(done_at) do
    local p = prefill[j]
    if rate[j] and p > 0 then
      local left = math.ceil(max(d - now, 0) * rate[j] / 1000)
      if left < p then prefill[j] = left end
    end
  end
end
local n_blocks = math.ceil(isl / bs)
-- The prompt tokens worker j would compute for this request: what its overlap leaves.
local function uncached(j) return max(isl - overlaps[j] * bs, 0) end

-- Busy: the router's reservations and the engine's last report count the same requests, so
-- they merge by max, never by sum (a report lags reservations in flight; reservations miss
-- what Redis forgot or what expired). The candidates' costs in the same pass.
local check_busy = max_requests > 0 or max_kv > 0
local busy, candidates, cost = {}, {}, {}
local best_overlap, lowest, highest = 0, nil, nil
local cheapest, second = nil, nil  -- the cheapest candidate, and the next lowest cost
for j = 1, n do
  if check_busy and (
    (max_requests > 0 and max(requests[j], rep_requests[j] or -1) >= max_requests)
    or (max_kv > 0 and (capacity[j] or 0) > 0
      and max(decode[j], rep_kv[j] or -1) >= max_kv * capacity[j])) then
    busy[#busy + 1] = j
  else
    candidates[#candidates + 1] = j
    local o = overlaps[j]
    if o > best_overlap then best_overlap = o end
    local blocks = (prefill[j] + isl) / bs - credit * o  -- prefill blocks, never below 0
    if blocks < 0 then blocks = 0 end
    local c = scale * blocks + decode[j] + n_blocks - o
    cost[j] = c
    if lowest == nil or c < lowest then
      lowest, second, cheapest = c, lowest, j
    elseif second == nil or c < second then
      second = c
    end
    if highest == nil or c > highest then highest = c end
  end
end
-- Bounded loads (SGLang's balance thresholds, per worker): a candidate `gap` or more requests
-- in flight ahead of the least loaded one and `ratio` times its load or more is passed over when
-- the best of the others costs no more than it does plus the queued (drained) prefill this
-- request would wait for there: giving up its cache then costs this request at most the wait its
-- queue would have cost it. So a prefix, however hot, cannot draw every request onto one worker
-- while another idles, and a long cached prefix is never given up for a short queue. The least
-- loaded is never passed over, so the pool is never empty. The reason says when the bound turned
-- the cheapest worker away.
-- It can only turn the cheapest worker away if the next lowest cost is within that worker's
-- queue of it: only then does it look at the candidates' request counts.
--
-- The queued prefill this request would wait for on worker j. An engine that schedules prompts
-- shortest first (workers.scheduler) computes a prompt before every queued one longer than it,
-- so of each request in flight there it waits for at most its own uncached tokens: a question
-- about a cached picture does not wait for the cold prompts queued beside it, while prompts of
-- one size (shape (d)'s) wait for each other in full. In arrival order it waits for all of it.
local function queued_wait(j)
  local q = prefill[j]
  if string.byte(schedules, j) == 49 then  -- '1': this worker computes the shortest first
    local ahead = requests[j] * uncached(j)
    if ahead < q then q = ahead end
  end
  return q
end
local pool, bounded = candidates, false
local least, most = nil, nil  -- the candidates' fewest and most requests in flight
if gap > 0 and second ~= nil and second <= lowest + scale * queued_wait(cheapest) / bs then
  for k = 1, #candidates do
    local r = requests[candidates[k]]
    if least == nil or r < least then least = r end
    if most == nil or r > most then most = r end
  end
end
if least ~= nil and most - least >= gap then
  local floor = max(least + gap, ratio * least)  -- as many requests as make a candidate far ahead
  local others, cheapest_ahead = nil, nil  -- the lowest cost of the rest, and of those ahead
  for k = 1, #candidates do
    local j = candidates[k]
    local c = cost[j]
    if requests[j] >= floor then
      if cheapest_ahead == nil or c < cheapest_ahead then cheapest_ahead = c end
    elseif others == nil or c < others then
      others = c
    end
  end
  if cheapest_ahead ~= nil and cheapest_ahead < others then
    local within, low, high = {}, nil, nil
    for k = 1, #candidates do
      local j = candidates[k]
      local c = cost[j]
      if requests[j] < floor or others > c + scale * queued_wait(j) / bs then
        within[#within + 1] = j
        if low == nil or c < low then low = c end
        if high == nil or c > high then high = c end
      end
    end
    if #within < #candidates then
      pool, bounded, lowest, highest = within, low > lowest, low, high
    end
  end
end
local sticky = false
if sticky_read ~= nil then
  sticky = sticky_read
elseif ARGV[3] ~= '' then
  sticky = redis.call('GET', ARGV[3])
end
-- A column of integers as one string of big-endian i64s: one bulk reply instead of an array
-- of numbers saves Redis's per-element conversion and the client's parsing (~30 us for three
-- columns of 64). unpack() is bounded by Lua's C stack, hence the chunks.
local formats = {}  -- by chunk length: the columns share one
local function packed_integers(values)
  local parts = {}
  for i = 1, #values, 1000 do
    local last = math.min(i + 999, #values)
    local size = last - i + 1
    formats[size] = formats[size] or '>' .. string.rep('i8', size)
    parts[#parts + 1] = struct.pack(formats[size], unpack(values, i, last))
  end
  return table.concat(parts)
end
-- The chosen worker's position in the list (false: all busy), and what Python needs to build
-- the scores if it is asked for them; busy workers by position (usually none).
local function reply(chosen, reason)
  if ARGV[36] == '1' then
    local named, places = {}, {}
    if chosen then named[1] = names[chosen] end
    for k = 1, #busy do
      named[#named + 1] = names[busy[k]]
      places[k] = #named
    end
    local function column(values) return chosen and struct.pack('>i8', values[chosen]) or '' end
    return {chosen and 1 or false, reason, best_overlap, column(overlaps), column(prefill),
      column(decode), places, named}
  end
  return {chosen, reason, best_overlap, packed_integers(overlaps), packed_integers(prefill),
    packed_integers(decode), busy, among and names or {}}
end
if #candidates == 0 then return reply(false, 'busy') end

local chosen, reason = nil, 'cost'
if mode == 'round_robin' then
  -- A preview (no request id) reads the counter; only a real decision moves it.
  local n
  if ARGV[4] == '' then
    n = (tonumber(redis.call('GET', ns .. ARGV[20])) or 0) + 1
  else
    n = redis.call('INCR', ns .. ARGV[20])
  end
  chosen, reason = candidates[(n % #candidates) + 1], 'round_robin'
elseif mode == 'random' then
  chosen, reason = candidates[math.floor(u * #candidates) + 1], 'random'
elseif #candidates == 1 then
  chosen, reason = candidates[1], 'only-candidate'
else
  if sticky then
    for k = 1, #pool do
      local j = pool[k]
      if names[j] == sticky and cost[j] <= lowest * (1 + slack) + 1e-9
        and best_overlap - overlaps[j] <= lead then
        chosen, reason = j, 'affinity'
      end
    end
  end
  if chosen == nil then
    if temperature <= 0 or highest - lowest <= 0 then
      local tied = {}
      local below = lowest + 1e-9 * math.max(1, math.abs(lowest))
      for k = 1, #pool do
        local j = pool[k]
        if cost[j] <= below then tied[#tied + 1] = j end
      end
      chosen = tied[math.min(math.floor(u * #tied) + 1, #tied)]
    else
      local weights, sum = {}, 0
      for k, j in ipairs(pool) do
        weights[k] = math.exp(-(cost[j] - lowest) / ((highest - lowest) * temperature))
        sum = sum + weights[k]
      end
      local target, acc = u * sum, 0
      chosen = pool[#pool]
      for k, j in ipairs(pool) do
        acc = acc + weights[k]
        if target < acc then chosen = j break end
      end
    end
  end
  if bounded and reason == 'cost' then reason = 'load-bound' end
end

local request_id = ARGV[4]
if request_id ~= '' then
  local worker = names[chosen]
  local prefill_tokens = uncached(chosen)
  -- The reservation, as LoadTracker.add makes it (a re-add replaces, never double counts),
  -- with when the worker's reserved prefill should now be done: queued behind what is left of
  -- it (all of it without an estimate).
  release(ns, worker, request_id)
  redis.call('HSET', ns .. REQUESTS_FAMILY .. worker, request_id, prefill_tokens .. ' ' .. n_blocks)
  local r = rate[chosen]
  now = now or server_time_ms()
  local drained_at = nil
  if r and prefill_tokens > 0 then
    -- (Without an estimate nothing of the worker's drained: its prefill column is all it holds.)
    local start = max(done_at[chosen] or (now + prefill[chosen] * 1000 / r), now)
    drained_at = math.ceil(start + prefill_tokens * 1000 / r)
  end
  adjust(ns, worker, prefill_tokens, n_blocks, 1, drained_at)
  redis.call('ZADD', ns .. EXPIRY_KEY, now + tonumber(ARGV[16]), worker .. '\n' .. request_id)
  -- Predicted blocks: siblings arriving before the worker's own events credit it with this
  -- prompt for a short while (approximate workers: for the approximate TTL, their only credit).
  local ttl = approximate[chosen] and tonumber(ARGV[18]) or tonumber(ARGV[17])
  if ttl > 0 and #packed > 0 then kv_predict(ns, worker, packed, now, ttl, approximate[chosen]) end
  if ARGV[3] ~= '' then redis.call('SET', ARGV[3], worker, 'PX', tonumber(ARGV[19])) end
end
return reply(chosen, reason)
