-- Atomically acknowledge a stage message and move its job on: to the next stage's stream,
-- to a results stream, to the dead-letter stream, or back to a stream for another try.
-- A crash before this script runs leaves the message pending (it will be reclaimed); a
-- crash after it leaves the job in its next place. Never both, never neither.
--
-- KEYS[1] source stream   KEYS[2] job state hash   KEYS[3] stats hash
-- KEYS[4] the node's sandbox set (touched only when ARGV[6] names an operation)
-- KEYS[5..7] the job's cancellation flags: job, group, submitter (read only when ARGV[8] ~= '')
-- KEYS[8 .. 7+d] destinations
-- ARGV[1] consumer group  ARGV[2] message id       ARGV[3] consumer that must own the message
--         ('' to skip the check)                   ARGV[4] state TTL in seconds (0 = none)
-- ARGV[5] stats field to increment ('' = none)     ARGV[6] 'SADD', 'SREM' or '' on KEYS[4]
-- ARGV[7] the sandbox id for ARGV[6]               ARGV[8] the job's submitted_at: refuse to
--         move a cancelled job ('' = no check)      ARGV[9] '1' when the job is in a group
-- ARGV[10] n = number of state field pairs         ARGV[11] d = number of destinations
-- ARGV[12 .. 11+2n] state fields and values, then for each destination: maxlen (0 = none),
-- payload.
-- Returns 1 when moved; 0 when this consumer no longer owns the message (stale delivery);
-- 2, 3 or 4 when the job was cancelled (by job, group or submitter) and nothing moved: the
-- message stays pending with the caller, who ends the job.
-- The job hash's msg_id becomes "<first destination stream> <its entry id>": the token that
-- the "running" mark (running.lua) of a stage must match, so a late mark never overwrites
-- this. The stream is part of it because entry ids are per stream: a job's entry here and
-- its next one can have the same id (a hand-off within the millisecond).

if ARGV[3] ~= '' then
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
  if #p == 0 or p[1][2] ~= ARGV[3] then
    return 0
  end
end

if ARGV[8] ~= '' then
  if redis.call('EXISTS', KEYS[5]) == 1 then
    return 2
  end
  if ARGV[9] == '1' and redis.call('EXISTS', KEYS[6]) == 1 then
    return 3
  end
  local by_submitter = redis.call('GET', KEYS[7])
  if by_submitter and tonumber(ARGV[8]) <= tonumber(by_submitter) then
    return 4
  end
end

redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])

local n = tonumber(ARGV[10])
local d = tonumber(ARGV[11])
local first_id = nil
local dest_at = 12 + 2 * n
for k = 8, 7 + d do
  local maxlen = tonumber(ARGV[dest_at])
  local payload = ARGV[dest_at + 1]
  dest_at = dest_at + 2
  local id
  if maxlen > 0 then
    id = redis.call('XADD', KEYS[k], 'MAXLEN', '~', maxlen, '*', 'data', payload)
  else
    id = redis.call('XADD', KEYS[k], '*', 'data', payload)
  end
  first_id = first_id or id
end

if n > 0 then
  local fields = {}
  for j = 0, 2 * n - 1 do
    fields[j + 1] = ARGV[12 + j]
  end
  fields[2 * n + 1] = 'msg_id'
  fields[2 * n + 2] = first_id and (KEYS[8] .. ' ' .. first_id) or ''
  redis.call('HSET', KEYS[2], unpack(fields))
end
if tonumber(ARGV[4]) > 0 then
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
if ARGV[5] ~= '' then
  redis.call('HINCRBY', KEYS[3], ARGV[5], 1)
end
if ARGV[6] == 'SADD' then
  redis.call('SADD', KEYS[4], ARGV[7])
elseif ARGV[6] == 'SREM' then
  redis.call('SREM', KEYS[4], ARGV[7])
end
return 1
