local function wake(waiters, list)
  local n = tonumber(redis.call('GET', waiters) or '0')
  if n > 0 then
    redis.call('DEL', waiters)
    for _ = 1, n do redis.call('LPUSH', list, '1') end
    redis.call('EXPIRE', list, ARGV[#ARGV])
  end
end
