"""A segment's LRU list: a doubly linked list threaded through the objects themselves (two pointers
each, where an ``OrderedDict`` entry took ~90 bytes). Links are keys, not objects, so objects never
form reference cycles; an object's links in its first location's segment are its own ``prev`` /
``next``, those in its other segments are ``Links`` in its ``Extra`` (one per location there). Touching, appending and evicting
from the head are O(1); nothing is ever scanned past (no deleted slots as in a plain dict).

Every object in a list is in the table's ``objects`` under its key (the table takes an object out of
its lists before it forgets it) and its links are found through it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar

import msgspec

OUT = "".join(("\x00", "not in a list"))   # a distinct string: compared by identity only


class Links(msgspec.Struct, gc=False):
    prev: str | None = OUT
    next: str | None = OUT


class Linked(Protocol):
    """What the list needs of an object (``objects.Obj`` is one): its key, its links in its first
    location's segment, and those in its other segments (``links``) when it has extras (``more``)."""

    key: str
    prev: str | None
    next: str | None

    @property
    def more(self) -> object | None: ...
    @property
    def committed(self) -> bool: ...
    @property
    def first_segment(self) -> int | None: ...
    def links(self, segment_id: int) -> Any: ...


Obj = TypeVar("Obj", bound=Linked)   # the table's object type (``objects.Obj``), passed in by ``Lru[Obj]``


def _node(obj: Linked, sid: int) -> Any:
    return obj if obj.more is None else obj.links(sid)


class Lru(Generic[Obj]):
    def __init__(self, segment_id: int, objects: dict[str, Obj]) -> None:
        self.sid = segment_id
        self.objects = objects
        self.head: str | None = None
        self.tail: str | None = None
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def _linked(self, obj: Obj) -> bool:
        n = _node(obj, self.sid)
        return n.prev is not OUT and (n is not obj or obj.first_segment == self.sid)

    def get(self, key: str) -> Obj | None:
        obj = self.objects.get(key)
        return obj if obj is not None and obj.committed and self._linked(obj) else None

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def __getitem__(self, key: str) -> Obj:
        obj = self.get(key)
        if obj is None:
            raise KeyError(key)
        return obj

    def __setitem__(self, key: str, obj: Obj) -> None:
        """Add at the most recent end; an object already here keeps its place (as an OrderedDict)."""
        if not self._linked(obj):
            self._insert(obj, last=True)

    def __delitem__(self, key: str) -> None:
        self._unlink(self[key])

    def first(self) -> Obj | None:
        """The least recently used object."""
        return None if self.head is None else self.objects[self.head]

    def append(self, obj: Obj) -> None:
        """Add an object not in this list (just committed) at the most recent end."""
        self._insert(obj, last=True)

    def discard(self, obj: Obj) -> None:
        """Take the object out if it is in this list (as the table's current object of its key)."""
        if self.objects.get(obj.key) is obj and obj.committed and self._linked(obj):
            self._unlink(obj)

    def touch(self, obj: Obj) -> None:
        """The object was used: it becomes the most recent. (The hot path of a read: an object with one
        location and its neighbours' links unrolled.)"""
        key, tail = obj.key, self.tail
        if tail is key:
            return
        if obj.more is not None:
            self._unlink(obj)
            self._insert(obj, last=True)
            return
        objects, sid = self.objects, self.sid
        p, nx = obj.prev, obj.next
        n = objects[nx]   # type: ignore[index]   # (not the tail: it has a next)
        (n if n.more is None else n.links(sid)).prev = p
        if p is None:
            self.head = nx
        else:
            n = objects[p]
            (n if n.more is None else n.links(sid)).next = nx
        n = objects[tail]   # type: ignore[index]
        (n if n.more is None else n.links(sid)).next = key
        obj.prev, obj.next = tail, None
        self.tail = key

    def move_to_end(self, key: str, last: bool = True) -> None:
        obj = self[key]
        self._unlink(obj)
        self._insert(obj, last)

    def _insert(self, obj: Obj, last: bool) -> None:
        key, sid = obj.key, self.sid
        node = obj if obj.more is None else obj.links(sid)   # (no extras: one location, this one)
        if last:
            node.prev, node.next = self.tail, None
            if self.tail is None:
                self.head = key
            else:
                _node(self.objects[self.tail], sid).next = key
            self.tail = key
        else:
            node.prev, node.next = None, self.head
            if self.head is None:
                self.tail = key
            else:
                _node(self.objects[self.head], sid).prev = key
            self.head = key
        self.n += 1

    def _unlink(self, obj: Obj) -> None:
        sid = self.sid
        node = _node(obj, sid)
        p, nx = node.prev, node.next
        if p is None:
            self.head = nx
        else:
            _node(self.objects[p], sid).next = nx   # type: ignore[index]
        if nx is None:
            self.tail = p
        else:
            _node(self.objects[nx], sid).prev = p   # type: ignore[index]
        node.prev = node.next = OUT
        self.n -= 1

    def __iter__(self) -> Iterator[str]:
        """Keys, least recent first (the list must not change while this runs)."""
        k, sid = self.head, self.sid
        while k is not None:
            yield k
            k = _node(self.objects[k], sid).next

    def __reversed__(self) -> Iterator[str]:
        k, sid = self.tail, self.sid
        while k is not None:
            yield k
            k = _node(self.objects[k], sid).prev

    def values(self, reverse: bool = False) -> Iterator[Obj]:
        objects = self.objects
        return (objects[k] for k in (reversed(self) if reverse else self))
