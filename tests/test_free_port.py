"""free_port: the ports handed to services a test or `specdec serve` starts are free, distinct, and outside the
kernel's ephemeral range (where outgoing connections could take them before the service binds)."""
import socket

from specdec.transport import host
from specdec.transport.host import ephemeral_port_floor, free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < ephemeral_port_floor() for p in ports)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(host, "ephemeral_port_floor", lambda: taken + 1)   # the range below holds it
        monkeypatch.setattr(host.random.Random, "randrange", lambda self, a, b: taken)
        port = free_port()                     # every draw is the taken port: the kernel's choice instead
        assert port != taken
