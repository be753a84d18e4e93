-- Add a backend (load 0), or refresh the info of one already known, keeping its counts
-- and its health state.
-- KEYS: backends, backends:down, backends:info
-- ARGV: url, info json, '1' to replace known info ('0' keeps what a server registered)
-- Returns 1 when the backend is new, 0 when it was known.
if ARGV[3] == '1' then
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
else
  redis.call('HSETNX', KEYS[3], ARGV[1], ARGV[2])
end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) or redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return 0
end
redis.call('ZADD', KEYS[1], 0, ARGV[1])
return 1
