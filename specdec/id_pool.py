"""A pool of integer ids (KV blocks, GDN state slots): take, give back, count what is free."""


class PoolExhausted(RuntimeError):
    pass


class IdPool:
    def __init__(self, size: int, name: str):
        self.size, self.name = size, name
        self._free = list(range(size - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"{self.name}: asked for {n}, {len(self._free)} free of {self.size}")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))
