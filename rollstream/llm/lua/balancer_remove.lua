-- Forget a backend. Leases still held on it are released as no-ops later.
-- KEYS: backends, backends:down, backends:info
-- ARGV: url
-- Returns 1 when the backend was known.
local known = redis.call('ZREM', KEYS[1], ARGV[1]) + redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
if known > 0 then
  return 1
end
return 0
