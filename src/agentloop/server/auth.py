"""Accounts and bearer tokens: who is calling, and whether they may see a process.

Tokens are random strings shown once when created; the store keeps only their SHA-256. A slow
password hash buys nothing here: a token carries 256 bits of randomness, so nobody can guess one
from its hash, and a fast hash lets every request be checked with one indexed lookup.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass

from agentloop.process.store import AccountRecord, Store, StoreError, TokenRecord

TOKEN_PREFIX = "al_"
ADMIN = "admin"
_ACCOUNT_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


class AccountError(ValueError):
    """A bad account or token operation (unknown account, taken name, invalid name)."""


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller behind a valid token."""

    account: str
    admin: bool
    token_id: str

    def may_see(self, owner: str) -> bool:
        """A process is visible to its owner and to admins, nobody else."""
        return self.admin or owner == self.account


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_account_name(name: str) -> str:
    if not _ACCOUNT_NAME.fullmatch(name):
        raise AccountError(
            f"invalid account name {name!r}: use 1-32 lowercase letters, digits, '-' or '_', starting with a letter"
        )
    return name


class Accounts:
    """Account and token operations over the store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def bootstrap(self) -> str | None:
        """On a fresh database create the admin account and return its first token (to show once);
        afterwards return None."""
        if await self.store.list_accounts():
            return None
        await self.create_account(ADMIN, admin=True)
        token, _ = await self.create_token(ADMIN, label="first start")
        return token

    async def create_account(self, name: str, *, admin: bool = False) -> AccountRecord:
        record = AccountRecord(check_account_name(name), admin, time.time())
        try:
            async with self.store.transaction():
                await self.store.create_account(record)
        except StoreError as exc:
            raise AccountError(str(exc)) from None
        return record

    async def create_token(self, account: str, *, label: str = "") -> tuple[str, TokenRecord]:
        """A new token for ``account``: the token itself (never stored) and its record."""
        if await self.store.get_account(account) is None:
            raise AccountError(f"no such account {account!r}")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        record = TokenRecord(secrets.token_hex(6), account, hash_token(token), label, time.time())
        async with self.store.transaction():
            await self.store.add_token(record)
        return token, record

    async def tokens(self, account: str | None = None) -> list[TokenRecord]:
        return await self.store.list_tokens(account)

    async def revoke(self, token_id: str) -> bool:
        async with self.store.transaction():
            return await self.store.revoke_token(token_id, time.time())

    async def still_valid(self, who: Principal) -> bool:
        """Whether the token ``who`` connected with is still good (not revoked, account still there):
        a long-lived stream or socket asks this now and then, so a revocation ends it too."""
        if await self.store.get_account(who.account) is None:
            return False
        return any(t.id == who.token_id and t.revoked_at is None for t in await self.store.list_tokens(who.account))

    async def authenticate(self, token: str) -> Principal | None:
        """The principal behind ``token``, or None if it is unknown, revoked or its account is gone."""
        if not token or len(token) > 512:
            return None
        record = await self.store.token_by_hash(hash_token(token))
        if record is None or record.revoked_at is not None:
            return None
        account = await self.store.get_account(record.account)
        if account is None:
            return None
        return Principal(account.name, account.admin, record.id)


def bearer(authorization: str | None) -> str:
    """The token in an ``Authorization: Bearer …`` header value, or "" when there is none."""
    if not authorization:
        return ""
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""
