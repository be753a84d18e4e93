-- Atomically acknowledge a stage message and move its job on: to the next stage's stream,
-- to a results stream, to the dead-letter stream, or back to a stream for another try.
-- A crash before this script runs leaves the message pending (it will be reclaimed); a
-- crash after it leaves the job in its next place. Never both, never neither.
--
-- KEYS[1] source stream   KEYS[2] job state hash   KEYS[3] stats hash   KEYS[4..] destinations
-- ARGV[1] consumer group  ARGV[2] message id       ARGV[3] consumer that must own the message
--         ('' to skip the check)                   ARGV[4] state TTL in seconds (0 = none)
-- ARGV[5] stats field to increment ('' = none)     ARGV[6] n = number of state field pairs
-- ARGV[7 .. 6+2n] state fields and values, then for each destination: maxlen (0 = none), payload
-- Returns 1 when moved, 0 when this consumer no longer owns the message (stale delivery).

if ARGV[3] ~= '' then
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
  if #p == 0 or p[1][2] ~= ARGV[3] then
    return 0
  end
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])

local n = tonumber(ARGV[6])
local i = 7
if n > 0 then
  local fields = {}
  for j = 0, 2 * n - 1 do
    fields[j + 1] = ARGV[i + j]
  end
  redis.call('HSET', KEYS[2], unpack(fields))
end
i = i + 2 * n

local ttl = tonumber(ARGV[4])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[2], ttl)
end
if ARGV[5] ~= '' then
  redis.call('HINCRBY', KEYS[3], ARGV[5], 1)
end

for k = 4, #KEYS do
  local maxlen = tonumber(ARGV[i])
  local payload = ARGV[i + 1]
  i = i + 2
  if maxlen > 0 then
    redis.call('XADD', KEYS[k], 'MAXLEN', '~', maxlen, '*', 'data', payload)
  else
    redis.call('XADD', KEYS[k], '*', 'data', payload)
  end
end
return 1
