-- KEYS: origins, entries, hits. ARGV: prefix, limit.
-- Returns {truncated 0/1, rows of {field, entry, hits}, snapshot record rows}.
local limit = tonumber(ARGV[2])
local rows, seen, cursor = {}, {}, '0'
repeat
  local page = redis.call('HSCAN', KEYS[2], cursor, 'COUNT', 1000)
  cursor = page[1]
  local items = page[2]
  for i = 1, #items, 2 do
    local field = items[i]
    if #rows <= limit and not seen[field] then
      seen[field] = true
      rows[#rows + 1] = {field, items[i + 1], redis.call('HGET', KEYS[3], field) or '0'}
    end
  end
until cursor == '0' or #rows > limit
local truncated = 0
if #rows > limit then
  truncated = 1
  rows[#rows] = nil
end
local snapshots, now = {}, clock()
for _, origin in ipairs(redis.call('SMEMBERS', KEYS[1])) do records(origin, now, snapshots) end
return {truncated, rows, snapshots}
