-- Move the best-ranked waiting jobs onto the init stream, so that it holds `count` unread
-- entries: sent by an init reader in the same write as its XREADGROUP ... COUNT count, which
-- then takes them. Each job moves whole (ZPOPMIN and XADD in one script): never in both places,
-- never in neither.
--
-- KEYS[1] init stream   KEYS[2] waiting sorted set
-- ARGV[1] the init consumer group   ARGV[2] count
-- Returns how many jobs moved.

if redis.call('ZCARD', KEYS[2]) == 0 then
  return 0  -- nothing waits: a read's usual case, kept to one command
end
local want = tonumber(ARGV[2]) - undelivered(KEYS[1], ARGV[1], tonumber(ARGV[2]))
if want <= 0 then
  return 0
end
local popped = redis.call('ZPOPMIN', KEYS[2], want)
for i = 1, #popped, 2 do
  local member = popped[i]
  redis.call('XADD', KEYS[1], '*', 'data', string.sub(member, 15), 'queued_ms', string.sub(member, 1, 13))
end
return #popped / 2
