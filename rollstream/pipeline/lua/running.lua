-- Mark a job "running" in a stage, unless it has already moved on. Workers send this
-- without waiting for it, so it may reach Redis after the job's hand-off (transition.lua);
-- the hand-off stores the job's next stream entry as msg_id, and a mark whose entry no
-- longer matches is dropped instead of overwriting a later state.
--
-- KEYS[1] job state hash   ARGV[1] "<stream> <entry id>" of the stage message being worked
--                          on (jobstate.entry_token)
-- ARGV[2 ..] state fields and values
-- Returns 1 when marked, 0 when the job had moved on.

local current = redis.call('HGET', KEYS[1], 'msg_id')
if current and current ~= '' and current ~= ARGV[1] then
  return 0
end
local fields = {}
for j = 2, #ARGV do
  fields[j - 1] = ARGV[j]
end
redis.call('HSET', KEYS[1], unpack(fields))
return 1
