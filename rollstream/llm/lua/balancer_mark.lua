-- Move a backend between the healthy heap and the ejected set, keeping its in-flight
-- count so the requests still running there are released correctly.
-- KEYS: source set, destination set (backends -> backends:down to eject, the reverse to readmit)
-- ARGV: url
-- Returns 1 when the backend moved, 0 when it was not in the source set.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], score, ARGV[1])
return 1
