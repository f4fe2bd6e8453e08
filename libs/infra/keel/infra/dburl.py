"""PostgreSQL URLs: credentials in and out, and libpq's TLS parameters as asyncpg needs them.

A ``postgresql://`` URL carries TLS as libpq spells it (``?sslmode=verify-full&sslrootcert=/ca.pem``).
SQLAlchemy's asyncpg dialect passes every query parameter to ``asyncpg.connect`` as a keyword, which has no
``sslmode`` (a ``TypeError`` at the first connection). ``split_tls(url)`` takes those parameters out and
returns what asyncpg's ``ssl=`` takes instead, with libpq's meaning:

==============  ===============================================================================
``sslmode``     ``ssl=``
==============  ===============================================================================
disable         ``False``: no TLS
allow, prefer   the same string (asyncpg: TLS when the server offers it, no verification)
require         an ``SSLContext`` that encrypts without verifying the server (like libpq, it
                verifies the chain when ``sslrootcert`` is given: then it is verify-ca)
verify-ca       an ``SSLContext`` that verifies the server's chain against ``sslrootcert``
verify-full     ... and that the server's name is the URL's host
==============  ===============================================================================

``sslrootcert`` is a CA file, or ``system`` for the system's trust store; without it the verifying modes use
``~/.postgresql/root.crt`` like libpq, and fail with a ``ValueError`` naming the fix when that is missing.
``sslcert``/``sslkey``/``sslpassword`` give a client certificate; ``sslcrl`` a revocation list. Any other
``ssl*`` parameter is refused (``ValueError``) rather than passed on to fail obscurely.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
_TLS_PARAMS = ("sslmode", "sslrootcert", "sslcert", "sslkey", "sslpassword", "sslcrl")
_SCHEMES = ("postgresql", "postgres", "postgresql+asyncpg")

TlsArgument = ssl.SSLContext | str | bool
"""What ``asyncpg.connect(ssl=...)`` takes."""


def _split(url: str) -> tuple[str, str, str, str, str]:
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"not a PostgreSQL URL (postgresql://...): {redact(url)!r}")
    return parts.scheme, parts.netloc, parts.path, parts.query, parts.fragment


def sqlalchemy_url(url: str) -> str:
    """``url`` with SQLAlchemy's asyncpg scheme (``postgresql+asyncpg://``)."""
    _, netloc, path, query, fragment = _split(url)
    return urlunsplit(("postgresql+asyncpg", netloc, path, query, fragment))


def split_tls(url: str) -> tuple[str, TlsArgument | None]:
    """(``url`` without libpq's TLS parameters, the ``ssl=`` argument for asyncpg or None when the URL
    has no ``sslmode``). ``ValueError`` for an unknown mode or parameter, or a missing CA file."""
    scheme, netloc, path, query, fragment = _split(url)
    params = parse_qsl(query, keep_blank_values=True)
    tls = {key: value for key, value in params if key in _TLS_PARAMS}
    unknown = sorted(key for key, _ in params if key.startswith("ssl") and key not in _TLS_PARAMS)
    if unknown:
        raise ValueError(f"database URL parameter(s) {', '.join(unknown)} are not supported; Keel understands "
                         f"{', '.join(_TLS_PARAMS)}")
    rest = urlencode([(key, value) for key, value in params if key not in _TLS_PARAMS])
    stripped = urlunsplit((scheme, netloc, path, rest, fragment))
    if not tls:
        return stripped, None
    mode = tls.get("sslmode", "prefer")
    return stripped, tls_argument(mode, tls, host=urlsplit(url).hostname)


def tls_argument(mode: str, params: dict[str, str], host: str | None = None) -> TlsArgument:
    """asyncpg's ``ssl=`` for libpq's ``sslmode`` and its companions (see the module's table)."""
    if mode not in SSL_MODES:
        raise ValueError(f"sslmode={mode!r} is not one of {', '.join(SSL_MODES)}")
    if mode == "disable":
        return False
    if mode in ("allow", "prefer"):
        return mode
    if mode == "require" and "sslrootcert" in params:
        mode = "verify-ca"  # libpq: require with a root certificate verifies the chain
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if mode == "require":
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context.check_hostname = mode == "verify-full"
        context.verify_mode = ssl.CERT_REQUIRED
        _load_roots(context, params.get("sslrootcert"), mode, host)
        if "sslcrl" in params:
            context.load_verify_locations(cafile=params["sslcrl"])
            context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    if "sslcert" in params:
        context.load_cert_chain(params["sslcert"], params.get("sslkey"), password=params.get("sslpassword"))
    elif "sslkey" in params:
        raise ValueError("sslkey is given without sslcert: pass both for a client certificate")
    return context


def _load_roots(context: ssl.SSLContext, rootcert: str | None, mode: str, host: str | None) -> None:
    if rootcert == "system":
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
        return
    path = Path(rootcert).expanduser() if rootcert else Path("~/.postgresql/root.crt").expanduser()
    if not path.is_file():
        given = f"sslrootcert={rootcert} does not exist" if rootcert else f"no sslrootcert, and {path} does not exist"
        raise ValueError(f"sslmode={mode} (database {host or '?'}) verifies the server's certificate, but {given}: "
                         f"add sslrootcert=<the CA file of the server's certificate> (or sslrootcert=system for "
                         f"the system's trust store) to the database URL")
    context.load_verify_locations(cafile=str(path))


def with_credentials(url: str, user: str, password: str | None) -> str:
    """``url`` with its user (and password, when given) replaced."""
    scheme, netloc, path, query, fragment = _split(url)
    host = netloc.rpartition("@")[2]
    auth = quote(user, safe="") + (f":{quote(password, safe='')}" if password is not None else "")
    return urlunsplit((scheme, f"{auth}@{host}", path, query, fragment))


def url_user(url: str) -> str | None:
    """The user name of ``url`` (None when it has none)."""
    username = urlsplit(url).username
    return unquote(username) if username else None


def has_password(url: str) -> bool:
    return urlsplit(url).password is not None


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs, errors and ``keel up``'s output)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit((parts.scheme, f"{user.split(':', 1)[0]}:***@{host}", parts.path, parts.query, parts.fragment))


__all__ = ["SSL_MODES", "TlsArgument", "has_password", "redact", "split_tls", "sqlalchemy_url", "tls_argument",
           "url_user", "with_credentials"]
