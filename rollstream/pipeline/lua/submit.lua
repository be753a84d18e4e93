-- Queue jobs for the init stage, each at most once: a job whose state hash exists already
-- (a submission retried after a lost reply, or the same job id sent twice) is skipped, so
-- a client may retry a submit without doubling work. All or nothing, like MULTI.
--
-- KEYS[1] init stream   KEYS[2] submitters sorted set   KEYS[3..] one job state hash per job
-- ARGV[1] now (score for the submitters)   ARGV[2] s = number of submitters
-- ARGV[3 .. 2+s] the submitters
-- then for each job, in KEYS order: payload, n = number of state field pairs, n pairs.
-- Returns one integer per job: 1 queued now, 0 known already.

local s = tonumber(ARGV[2])
for i = 3, 2 + s do
  redis.call('ZADD', KEYS[2], ARGV[1], ARGV[i])
end
local at = 3 + s
local out = {}
for k = 3, #KEYS do
  local payload = ARGV[at]
  local n = tonumber(ARGV[at + 1])
  if redis.call('EXISTS', KEYS[k]) == 0 then
    local fields = {}
    for j = 1, 2 * n do
      fields[j] = ARGV[at + 1 + j]
    end
    redis.call('HSET', KEYS[k], unpack(fields))
    redis.call('XADD', KEYS[1], '*', 'data', payload)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
  at = at + 2 + 2 * n
end
return out
