-- Queue jobs for the init stage, each at most once: a job whose state hash exists already
-- (a submission retried after a lost reply, or the same job id sent twice) is skipped, so
-- a client may retry a submit without doubling work. All or nothing, like MULTI.
--
-- A job goes onto the init stream at once only while nothing waits ahead of it (no unread
-- entry there, nobody in the waiting room): that wakes an idle reader. Otherwise it waits in
-- the waiting room by rank (init_queue_common.lua), and readers move it on (init_feed.lua).
--
-- KEYS[1] init stream   KEYS[2] submitters sorted set   KEYS[3] waiting room
-- KEYS[4..] one job state hash per job
-- ARGV[1] now (score for the submitters)   ARGV[2] s = number of submitters
-- ARGV[3 .. 2+s] the submitters   ARGV[3+s] the init consumer group
-- then for each job, in KEYS order: payload, rank offset (s, from its priority),
-- n = number of state field pairs, n pairs.
-- Returns one integer per job: 1 queued now, 0 known already.

local s = tonumber(ARGV[2])
for i = 3, 2 + s do
  redis.call('ZADD', KEYS[2], ARGV[1], ARGV[i])
end
local ahead = redis.call('ZCARD', KEYS[3])
if ahead == 0 then
  ahead = undelivered(KEYS[1], ARGV[3 + s], 1)
end
local queued_ms = now_ms()
local at = 4 + s
local out = {}
for k = 4, #KEYS do
  local payload = ARGV[at]
  local offset_ms = math.floor(tonumber(ARGV[at + 1]) * 1000)
  local n = tonumber(ARGV[at + 2])
  if redis.call('EXISTS', KEYS[k]) == 0 then
    local fields = {}
    for j = 1, 2 * n do
      fields[j] = ARGV[at + 2 + j]
    end
    redis.call('HSET', KEYS[k], unpack(fields))
    if ahead == 0 then
      redis.call('XADD', KEYS[1], '*', 'data', payload)
    else
      redis.call('ZADD', KEYS[3], queued_ms + offset_ms, string.format('%013d', queued_ms) .. ':' .. payload)
    end
    ahead = ahead + 1
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
  at = at + 3 + 2 * n
end
return out
