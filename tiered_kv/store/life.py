"""A store's life: open, bound to one KV layout (bind), closing, closed.

The store makes one `StoreLife` and hands it to each component that must refuse work once the
store closes (`check_open`: no new lease, no background move). Its flags change under the store
lock.
"""

from __future__ import annotations

from ..errors import BankClosedError


class StoreLife:
    def __init__(self) -> None:
        self.bound = False  # bind() made the tiers
        self.closing = False  # close() began: no new lease, no background move
        self.closed = False

    @property
    def is_closing(self) -> bool:
        return self.closing or self.closed

    def check_open(self) -> None:
        if self.closing or self.closed:
            raise BankClosedError("this TierStore is closed (or closing); create a new store and bank")


__all__ = ["StoreLife"]
