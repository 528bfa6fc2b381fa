"""`trace-reducer view ROOT`: the runs under a root as a list with search, filters and sorting,
each opening its run page — served (live as bundles are written) or written as a static site."""

from __future__ import annotations

import asyncio
import hashlib
import html
import json
import os
import re
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, NamedTuple, cast

from grpc_common import HTTP_IDLE_SECONDS, addressed_to_loopback, http_runner_options, same_secret
from rollout.trace.v1 import state_pb2

from ..batch._listing import (
    FILTER_NAMES,
    ReadProgress,
    Run,
    RunFilter,
    check_sort_key,
    list_runs,
    sort_runs,
)
from ..bundle._confine import BundleRoot, write_dir_aside
from ..bundle._errors import BundleError, ReductionError
from ..reduce._forks import BundleForkResolver
from ._run_page import RunLinks
from ._view import (
    _PLACEHOLDER,
    PAGE_SCRIPT,
    _asset,
    _script_json,
    reduce_reader_for_view,
    render_view,
    save_view,
    script_hash,
    write_assets,
    write_page,
)

__all__ = ["SiteServer", "write_site"]

# The list page carries this much of each run's text for its search box.
PAGE_TEXT_CHARS = 1000
# The list draws this many rows, and "show more" as many again (the served list asks its
# server for as many as it draws).
LIST_PAGE_ROWS = 500
# Why a request to the tokenless viewer by another name than loopback's is refused.
LOOPBACK_NAMES_ONLY = (
    "this viewer answers only requests to localhost, 127.0.0.1 or [::1] (it has no token); "
    "serve it with --token-env to reach it by another name"
)
TOKEN_COOKIE = "trace_view_token"  # noqa: S105 - the name of the cookie, not a secret
_PLAIN_NAME_BYTE = re.compile(r"[A-Za-z0-9.-]")
# A listing of the served root that took this long is answered again for a while after it.
SLOW_LISTING_SECONDS = 0.25
# How many answers of /api/runs about one listing are kept (each open list page asks one).
_KEPT_ANSWERS = 64
# Page names stay under the 255 bytes most file systems allow a name.
_MAX_PAGE_STEM = 200


def _relative(root: str, bundle: str) -> str:
    return os.path.relpath(bundle, root)


# A run as listed and the link to its page.
_Listed = list[tuple[Run, str]]


def _listed_runs(
    root: str,
    href: Callable[[str], str],
    warn: Callable[[str], None],
    progress: ReadProgress | None = None,
) -> _Listed:
    """Every run under root with the link to its page (`href` of its path under root); a
    directory passed over (a name that is not UTF-8, one that cannot be listed) is said to
    `warn`, as `list` says it.

    A trace.binpb that turns up in the served root later is passed over: refusing the root
    then (as `list` refuses a bundle given as a root) answered every page with an error."""
    listing = list_runs(root, bundle_root_refused=False, warn=warn, progress=progress)
    return [(run, href(_relative(root, run["bundle"]))) for run in listing.runs]


_PAGE_JSON = json.JSONEncoder(separators=(",", ":"))


def _page_runs_json(listed: _Listed) -> bytes:
    """`{"runs": [...]}`, the runs as the list page shows them: each `list --json`'s fields, the
    start of its search text and its link, spliced from the line the listing keeps rather than
    decoded and encoded again (the served list asks for it every 2 s)."""
    encode = _PAGE_JSON.encode
    parts = [
        f'{run.json_line()[:-1]},"text":{encode(run.text[:PAGE_TEXT_CHARS])},'
        f'"href":{encode(link)}}}'
        for run, link in listed
    ]
    return f'{{"runs":[{",".join(parts)}]}}'.encode()


class _Query(NamedTuple):
    """A question /api/runs is asked: `list`'s filters, sort and limit, by the same names."""

    chosen: RunFilter
    sort: str
    limit: int | None
    # Its canonical spelling, under which its answer to a listing is kept; "" for none kept.
    key: str


# The served list page's own question: the newest runs first, a page of them.
_PAGE_QUERY = ("sort", "-started"), ("limit", str(LIST_PAGE_ROWS))
_QUERY_NAMES = (*FILTER_NAMES, "sort", "limit")


def _parse_query(items: list[tuple[str, str]]) -> _Query:
    """The question the parameters ask (`list`'s filter names, `sort`, `limit`); ValueError
    says what is wrong, naming the parameter."""
    values: dict[str, list[str]] = {}
    for name, value in items:
        if name not in _QUERY_NAMES:
            raise ValueError(
                f"unknown parameter {name!r}: /api/runs takes {', '.join(_QUERY_NAMES)}"
            )
        values.setdefault(name, []).append(value)
    chosen = RunFilter.of(values, prefix="")
    sort = check_sort_key(values.get("sort", ["started"])[-1], name="sort")
    limit = None
    if "limit" in values:
        given = values["limit"][-1]
        # ASCII digits, few enough for int() to take them all (no "²", no 5,000 digits).
        if not (given.isascii() and given.isdigit() and len(given) <= 12):
            raise ValueError(f"limit expects a whole number, 0 or more; got {given[:40]!r}")
        limit = int(given)
    # An age (`since=2h`) moves with the clock: its answer is never kept.
    key = "" if "since" in values else urllib.parse.urlencode(sorted(items))
    return _Query(chosen, sort, limit, key)


def _facets(listed: _Listed) -> dict[str, list[str]]:
    """What the served list's menus offer: the statuses, integrities and models its runs have,
    and their reward names (the rewards column sorts by the first)."""
    statuses: set[str] = set()
    integrities: set[str] = set()
    models: set[str] = set()
    rewards: set[str] = set()
    for run, _ in listed:
        statuses.add(run["status"])
        integrities.add(run["integrity"])
        models.add(run["model"])
        rewards.update(run["rewards"])
    return {
        "status": sorted(statuses),
        "integrity": sorted(filter(None, integrities)),
        "model": sorted(filter(None, models)),
        "reward": sorted(rewards),
    }


def _warm_search(listed: _Listed) -> None:
    for run, _ in listed:
        run.searched_text()


def _answer(listed: _Listed, query: _Query, facets: dict[str, list[str]]) -> bytes:
    """/api/runs's answer to a question: the runs it chooses, in its order, at most its limit
    of them, as the list page shows them; how many it chooses, of how many; the facets."""
    chosen = [(run, link) for run, link in listed if query.chosen.matches(run)]
    # sort_runs orders the runs alone: each one's link found again by the run.
    links = {id(run): link for run, link in chosen}
    ordered = sort_runs([run for run, _ in chosen], query.sort)
    shown = ordered if query.limit is None else ordered[: query.limit]
    body = _page_runs_json([(cast(Run, run), links[id(run)]) for run in shown])
    more = _PAGE_JSON.encode({"matching": len(chosen), "total": len(listed), "facets": facets})
    return body[:-1] + b"," + more[1:].encode()


def _tag_of(body: bytes) -> str:
    return f'"{hashlib.blake2b(body, digest_size=16).hexdigest()}"'


class _Snapshot(NamedTuple):
    """One listing of the root: the runs with their links, the list page's JSON of them and its
    entity tag, and when the listing ended and how long it took (by the listing's clock)."""

    listed: _Listed
    body: bytes
    tag: str
    ended: float
    took: float


def _snapshot_of(listed: _Listed) -> tuple[_Listed, bytes, str]:
    body = _page_runs_json(listed)
    return listed, body, _tag_of(body)


class _SharedListing:
    """The served root's runs, listed once for every request that asks while a listing runs,
    and a slow listing reused for a while after it ends.

    The list page polls (every 2 s, per open tab) and every run page links its family, and a
    root of 100,000 runs takes seconds of CPU to list, each request listing it alone. A
    listing that took `took` >= `slow` seconds is therefore answered again until 2 x `took`
    after it ended, so listing keeps at most about a third of the server busy however many
    pages ask; after that, the first request starts the next listing and, like every request
    until it ends, is answered the slow one, so what a page shows is at most about 4 x `took`
    old and no request waits for a listing but the first. A quicker one is never reused, so a
    small root is listed afresh for each request. A listing that fails is dropped: the next
    request waits for one of its own (and is told why when it fails too)."""

    def __init__(
        self,
        list_now: Callable[[], tuple[_Listed, bytes, str]],
        *,
        slow: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._list_now = list_now
        self._slow = slow
        self._clock = clock
        self._latest: _Snapshot | None = None
        self._running: asyncio.Future[_Snapshot] | None = None

    async def get(self) -> _Snapshot:
        latest = self._latest
        stale = None
        if latest is not None and latest.took >= self._slow:
            if self._clock() - latest.ended < 2 * latest.took:
                return latest
            stale = latest
        running = self._running
        if running is None:
            running = self._running = asyncio.ensure_future(self._list())
            # Every waiter may be gone (their clients closed) when a listing fails.
            running.add_done_callback(_retrieved)
        if stale is not None:
            # A slow listing's successor is on its way: the one before answers meanwhile, so
            # no request (a search typed into the list page) waits seconds for it.
            return stale
        # Shielded: one waiter's client closing must not stop the listing for the others.
        return await asyncio.shield(running)

    async def _list(self) -> _Snapshot:
        started = self._clock()
        try:
            listed, body, tag = await asyncio.to_thread(self._list_now)
        except BaseException:
            # The next request waits for a listing of its own, and hears why this one failed.
            self._latest = None
            raise
        finally:
            self._running = None
        ended = self._clock()
        latest = self._latest
        if latest is not None and latest.tag == tag:
            # Nothing changed: the runs listed before stay, and what was worked out about them
            # (their fields read, their text lower-cased, the answers given) with them.
            listed, body = latest.listed, latest.body
        snapshot = _Snapshot(listed, body, tag, ended, ended - started)
        self._latest = snapshot
        return snapshot


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class _Links:
    """Every run's link by thread id, and for each page only its own family's: its fork
    ancestors and parent, the runs that continue it, and the others of its fork group.

    A page carried every run of the root before: a site of 1,500 one-turn rollouts was 524 MB,
    each page 0.33 MB of links it never showed, growing with the square of the runs."""

    def __init__(self, listed: _Listed) -> None:
        self._by_thread: dict[str, dict[str, Any]] = {}
        self._children: dict[str, list[str]] = {}
        self._groups: dict[str, list[str]] = {}
        for run, link in listed:
            thread = run["thread_id"]
            if not thread:
                continue
            fork = run["fork"] or {}
            info = {
                "href": link,
                "status": run["status"],
                "rewards": run["rewards"],
                "parent_thread_id": fork.get("parent_thread_id", ""),
                "group_id": fork.get("group_id", ""),
                "repetition_index": fork.get("repetition_index", 0),
            }
            self._by_thread[thread] = info
            if info["parent_thread_id"]:
                self._children.setdefault(info["parent_thread_id"], []).append(thread)
            if info["group_id"]:
                self._groups.setdefault(info["group_id"], []).append(thread)

    def for_page(
        self, trace: state_pb2.RolloutTrace, href: Callable[[str], str] = lambda href: href
    ) -> RunLinks:
        """What the page of `trace` links (_run.js: parent, ancestors, children, group), each
        href passed through `href` (to make it relative to where the page sits)."""
        me = trace.root_thread_id
        family = {me, *self._children.get(me, ())}
        if trace.HasField("fork"):
            fork = trace.fork
            family.add(fork.parent_thread_id)
            family.update(link.thread_id for link in fork.ancestors)
            family.update(self._groups.get(fork.group_id, ()) if fork.group_id else ())
        return {
            "runs": {
                thread: {**info, "href": href(info["href"])}
                for thread in sorted(family)
                if (info := self._by_thread.get(thread)) is not None
            }
        }


def render_list(runs_json: bytes, *, served: bool, title: str, tag: str | None = None) -> str:
    """The list page of `runs_json`: for a static site every run (_page_runs_json's), which the
    page searches, filters and sorts itself; served, /api/runs's answer to the page's own
    question (_PAGE_QUERY), the page asking its server again for each change. `tag`, that
    answer's entity tag, lets the served page's first poll be answered 304."""
    # One JSON object: the runs' bytes spliced in after the page's own fields. Inside <script>
    # no `<` may survive (see _script_json); in JSON one occurs only within a string.
    head = _script_json({"served": served, "tag": tag, "page_rows": LIST_PAGE_ROWS})
    data = f"{head[:-1]},{runs_json.decode()[1:]}".replace("<", "\\u003c")
    page_script = _asset(PAGE_SCRIPT)
    script = _asset("_list.js")
    values = {
        "TITLE": html.escape(title),
        "STYLE": _asset("_view.css"),
        "SCRIPT_HASH": f"{script_hash(page_script)} {script_hash(script)}",
        "CONNECT": "'self'" if served else "'none'",
        "PAGE_SCRIPT": page_script,
        "SCRIPT": script,
        "DATA": data,
    }
    return _PLACEHOLDER.sub(lambda match: values[match[1]], _asset("_list.html"))


def _static_name(relative: str) -> str:
    """A run's page name: one per bundle path (every byte outside [A-Za-z0-9.-] spelled `_xx`,
    so no two paths share a name), its end a digest when it would be too long a name."""
    name = "".join(
        chr(byte) if byte < 0x80 and _PLAIN_NAME_BYTE.match(chr(byte)) else f"_{byte:02x}"
        for byte in os.fsencode(relative)
    )
    if len(name) > _MAX_PAGE_STEM:
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        name = f"{name[: _MAX_PAGE_STEM - 17]}-{digest}"
    return name + ".html"


def write_site(
    root: str,
    output: str | os.PathLike[str],
    *,
    warn: Callable[[str], None] = lambda _: None,
    reading: ReadProgress | None = None,
    started: Callable[[int], None] = lambda _: None,
    progress: Callable[[int, int], None] = lambda _count, _unshown: None,
) -> Path:
    """The list (index.html) and every run's page (runs/*.html) under output, for reading
    offline: relative links, nothing fetched. Output is replaced whole once every page is
    written (site_place_problem says what it may be). Returns the index's path. `warn` is told of
    each directory passed over and of each run whose page says why it cannot be shown;
    `reading` of the bundles the listing reads afresh (as list_runs's `progress`);
    `started(total)` once the runs are listed, `progress(pages, unshown)` as pages are
    written."""
    target = Path(output)
    problem = site_place_problem(target)
    if problem is not None:
        raise BundleError(f"{target}: {problem}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written into a directory beside output, which replaces it at the end: stopped part-way
    # (Ctrl-C, a full disk), output is still the site before (or nothing), never half of each.
    write_dir_aside(
        target,
        lambda site: _fill_site(root, site, warn, reading, started, progress),
    )
    return target / "index.html"


SITE_ENTRIES = frozenset({"index.html", "runs", "assets"})
# What a site writes in its directories: run pages (_static_name) and content-named assets.
_SITE_FILES = {
    "runs": re.compile(r"[A-Za-z0-9._-]+\.html"),
    "assets": re.compile(r"[a-z]+-[0-9a-f]{16}\.(?:css|js)"),
}


def site_place_problem(target: Path) -> str | None:
    """Why a static site cannot be written at target, None if it can: a site replaces the
    directory there whole, so that must be a site written before (or empty, or new), never a
    directory of other files (in it, or in its runs/ or assets/), nor a symbolic link (which
    would be written through)."""
    if target.is_symlink():
        return "a symbolic link; give the directory itself"
    if not target.is_dir():
        return None  # new (a file there is check_output_dir's to refuse)
    others = [name for name in os.listdir(target) if name not in SITE_ENTRIES]
    for folder, written in _SITE_FILES.items():
        # Was: only DIR's own names were looked at; a file of the user's in runs/ or assets/
        # (a stylesheet of their own, notes) was removed with the site before.
        inside = target / folder
        if inside.is_dir() and not inside.is_symlink():
            others += (
                f"{folder}/{name}" for name in os.listdir(inside) if not written.fullmatch(name)
            )
    others.sort()
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        return (
            f"holds files that are not a site's ({shown}), which writing the site would "
            "remove; give a new or empty directory, or one a site was written to before"
        )
    return None


def _fill_site(
    root: str,
    target: Path,
    warn: Callable[[str], None],
    reading: ReadProgress | None,
    started: Callable[[int], None],
    progress: Callable[[int, int], None],
) -> None:
    # Made as mkdir makes any directory (0755 under umask 022), as the pages are made as any
    # file (write_page): a web server running as another user can serve the site.
    (target / "runs").mkdir()
    (target / "assets").mkdir()
    # One copy of the pages' style and scripts for the whole site, not one a page.
    assets = write_assets(target / "assets", "../assets/")
    listed = _listed_runs(root, lambda relative: f"runs/{_static_name(relative)}", warn, reading)
    started(len(listed))
    links = _Links(listed)
    confined = BundleRoot(root)
    for run, _ in listed:
        relative = _relative(root, run["bundle"])
        page = target / "runs" / _static_name(relative)
        title = f"rollout {relative}"
        try:
            data = _reduce_confined(confined, relative)
        except (BundleError, ReductionError, OSError) as error:
            # The list links every run: a page saying why beats a link to nothing.
            reason = unshown_reason(error)
            write_page(render_unshown(title, reason), page)
            warn(f"{relative}: {reason} (its page says so)")
            progress(1, 1)
            continue
        # A run page sits one level down: its links to other runs are siblings.
        page_links = links.for_page(data.trace, lambda href: href.removeprefix("runs/"))
        save_view(data, page, title, links=page_links, assets=assets)
        progress(1, 0)
    write_page(
        render_list(_page_runs_json(listed), served=False, title=f"rollouts under {root}"),
        target / "index.html",
    )


def unshown_reason(error: BundleError | ReductionError | OSError) -> str:
    """Why a run's page cannot be shown, in the words its served page answers with."""
    if isinstance(error, ReductionError):
        return f"records contradict each other: {error}"
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    return str(error)


def render_unshown(title: str, reason: str) -> str:
    """A static site's page for a run that cannot be shown: no script, the reason, the way
    back to the list."""
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "base-uri 'none'; form-action 'none'\">\n"
        f"<title>{html.escape(title)}</title>\n</head>\n<body>\n"
        f"<h1>{html.escape(title)}</h1>\n"
        f'<p id="unshown">This run cannot be shown: {html.escape(reason)}</p>\n'
        '<p><a href="../index.html">all runs</a></p>\n</body>\n</html>\n'
    )


def _reduce_confined(root: BundleRoot, relative: str) -> Any:
    bundle = root.open(relative)
    try:
        reader = bundle.reader()
        # A fork's parent is looked for from the root again, never by the bundle's path.
        forks = BundleForkResolver.beside(bundle, every_payload=True)
        return reduce_reader_for_view(reader, dir_fd=bundle.dir_fd, forks=forks)
    finally:
        bundle.close()


class SiteServer:
    """The served viewer: `/` the list, `/run/<bundle>` a run page, `/api/runs` the list as
    JSON, `/api/watch/<bundle>` a run's growth as server-sent events. Bound elsewhere than
    loopback, every request needs the token (once in the URL, then a cookie). `warn` is told
    of each directory passed over once, not on every refresh of the list."""

    def __init__(
        self,
        root: str,
        token: str | None,
        *,
        warn: Callable[[str], None] = lambda _: None,
        idle_timeout: float = HTTP_IDLE_SECONDS,
    ) -> None:
        self.root = os.path.abspath(root)
        self._idle_timeout = idle_timeout
        self._confined = BundleRoot(self.root)
        self._token = token
        self._warn = warn
        self._warned: set[str] = set()
        self._listing = _SharedListing(
            lambda: _snapshot_of(self._runs()), slow=SLOW_LISTING_SECONDS
        )
        # The latest listing's facets and the answers given about it, by its tag: the list
        # pages poll with the same question every 2 s, and a root of 100,000 runs takes a
        # fraction of a second to filter and sort.
        self._answered_tag = ""
        self._facets: asyncio.Future[dict[str, list[str]]] | None = None
        self._answers: dict[str, tuple[bytes, str]] = {}
        self._runner: Any = None
        self.address = ""

    async def start(self, host: str, port: int) -> str:
        from aiohttp import web

        @web.middleware
        async def guard(request: Any, handler: Any) -> Any:
            return await self._guard(request, handler)

        app = web.Application(middlewares=[guard])
        app.router.add_get("/", self._list)
        app.router.add_get("/api/runs", self._api_runs)
        app.router.add_get("/run/{bundle:.+}", self._run)
        app.router.add_get("/api/watch/{bundle:.+}", self._watch)
        # A client that goes away cancels its handler: a live run's watch otherwise went on
        # following the bundle (a descriptor and a poll every 50 ms) for as long as it was
        # written, one more at every reload of the page. One that sends no request head
        # within the idle timeout loses its connection.
        self._runner = web.AppRunner(
            app, **http_runner_options(f"{__name__}.http", self._idle_timeout)
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_port=False)
        await site.start()
        bound = self._runner.addresses[0]
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.address = f"http://{shown}:{bound[1]}/"
        return self.address

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- the token ---------------------------------------------------------------------------

    async def _guard(self, request: Any, handler: Any) -> Any:
        from aiohttp import web

        if self._token is None and not addressed_to_loopback(request.headers.get("Host")):
            # Without a token it is bound to loopback: another name is DNS rebinding.
            return web.Response(status=403, text=f"{LOOPBACK_NAMES_ONLY}\n")
        if self._token is not None:
            given = request.query.get("token")
            if given is not None and same_secret(given, self._token):
                # Into a cookie, and out of the address bar (and any Referer).
                rest = {k: v for k, v in request.query.items() if k != "token"}
                response = web.Response(
                    status=302, headers={"Location": str(request.rel_url.with_query(rest))}
                )
                response.set_cookie(
                    TOKEN_COOKIE, self._token, httponly=True, samesite="Strict", path="/"
                )
                return response
            cookie = request.cookies.get(TOKEN_COOKIE, "")
            if not same_secret(cookie, self._token):
                return web.Response(
                    status=401, text="this viewer needs its token: open the address it printed\n"
                )
        try:
            response = await handler(request)
        except web.HTTPException:
            raise
        except Exception as error:  # noqa: BLE001 - one line for the reader, never a traceback
            print(
                f"trace-reducer: error: {request.path}: {type(error).__name__}: {error}",
                file=sys.stderr,
                flush=True,
            )
            return web.Response(status=500, text="the viewer failed on this request\n")
        if not response.prepared:  # an event stream set its own headers when it began
            response.headers.setdefault("X-Content-Type-Options", "nosniff")
            response.headers.setdefault("Referrer-Policy", "no-referrer")
            response.headers.setdefault("Cache-Control", "no-store")
        return response

    # -- handlers ------------------------------------------------------------------------------

    def _runs(self) -> _Listed:
        return _listed_runs(
            self.root,
            lambda relative: "run/" + urllib.parse.quote(relative, safe="/"),
            self._warn_once,
        )

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            self._warn(message)

    async def _listed(self) -> _Snapshot | Any:
        """The root's latest listing, or the 503 that says why it cannot be listed (the root
        removed or unreadable while served): the operator is told once, the page keeps the
        list it has and asks again at its next poll."""
        from aiohttp import web

        try:
            return await self._listing.get()
        except BundleError as error:
            reason = f"the served root cannot be listed: {error}"
            self._warn_once(reason)
            return web.Response(status=503, text=f"{reason}\n")

    async def _list(self, request: Any) -> Any:
        from aiohttp import web

        listing = await self._listed()
        if not isinstance(listing, _Snapshot):
            return listing
        body, tag = await self._answer(listing, _parse_query(list(_PAGE_QUERY)))
        text = render_list(body, served=True, title=f"rollouts under {self.root}", tag=tag)
        return web.Response(text=text, content_type="text/html")

    async def _api_runs(self, request: Any) -> Any:
        from aiohttp import web

        try:
            query = _parse_query(list(request.query.items())) if request.query else None
        except ValueError as error:
            return web.Response(status=400, text=f"{error}\n")
        listing = await self._listed()
        if not isinstance(listing, _Snapshot):
            return listing
        if query is None:
            body, tag = listing.body, listing.tag
        else:
            body, tag = await self._answer(listing, query)
        # The list polls every 2 s: an unchanged answer (the usual one) goes without its body,
        # which for a root of thousands of runs is megabytes a poll, and as much JSON to parse.
        if tag in _entity_tags(request.headers.get("If-None-Match", "")):
            return web.Response(status=304, headers={"ETag": tag})
        return web.Response(body=body, content_type="application/json", headers={"ETag": tag})

    async def _answer(self, listing: _Snapshot, query: _Query) -> tuple[bytes, str]:
        """The answer to query about listing, and its tag: kept while the listing is the latest,
        so the same question asked again of the same runs is not worked out again."""
        if self._facets is None or listing.tag != self._answered_tag:
            self._answered_tag = listing.tag
            self._facets = asyncio.ensure_future(asyncio.to_thread(_facets, listing.listed))
            self._facets.add_done_callback(_retrieved)
            self._answers = {}
            # The searched text of each run made ready meanwhile, for the first search typed
            # (half a second of lower-casing at 100,000 runs otherwise, in that search's answer).
            warming = asyncio.ensure_future(asyncio.to_thread(_warm_search, listing.listed))
            warming.add_done_callback(_retrieved)
        kept = self._answers.get(query.key) if query.key else None
        if kept is not None:
            return kept
        # Shielded, as the listing is: one client going must not stop it for the others.
        facets = await asyncio.shield(self._facets)
        body = await asyncio.to_thread(_answer, listing.listed, query, facets)
        answer = body, _tag_of(body)
        if query.key and listing.tag == self._answered_tag:
            if len(self._answers) >= _KEPT_ANSWERS:
                self._answers.pop(next(iter(self._answers)))
            self._answers[query.key] = answer
        return answer

    async def _run(self, request: Any) -> Any:
        from aiohttp import web

        relative = request.match_info["bundle"]
        try:
            data = await asyncio.to_thread(_reduce_confined, self._confined, relative)
            listed = (await self._listing.get()).listed
        except BundleError as error:
            return web.Response(status=404, text=f"{unshown_reason(error)}\n")
        except ReductionError as error:
            return web.Response(status=422, text=f"{unshown_reason(error)}\n")
        # Links from /run/<bundle> to /run/<other>: relative to this page's directory.
        depth = relative.count("/")
        up = "../" * (depth + 1)
        links = _Links(listed).for_page(data.trace, lambda href: up + href)
        live = None
        if not data.trace.recording_complete:
            live = up + "api/watch/" + urllib.parse.quote(relative, safe="/")
        page = render_view(data, f"rollout {relative}", links=links, live_url=live)
        return web.Response(text=page, content_type="text/html")

    async def _watch(self, request: Any) -> Any:
        from aiohttp import web

        from ._watch import follow_bundle

        relative = request.match_info["bundle"]
        try:
            bundle = await asyncio.to_thread(self._confined.open, relative)
        except BundleError as error:
            return web.Response(status=404, text=f"{error}\n")
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Content-Type-Options": "nosniff",
            }
        )
        try:
            bundle.release_directory()
            await response.prepare(request)
            follow = follow_bundle(
                bundle.trace, Path(bundle.display_dir), forks=BundleForkResolver.beside(bundle)
            )
            async for update in _updates(follow):
                records, final = update
                data = json.dumps({"records": records, "final": final})
                await response.write(f"data: {data}\n\n".encode())
                if final:
                    break
        except (ConnectionResetError, ReductionError, OSError):
            pass
        finally:
            bundle.trace.close()
        return response


def _entity_tags(header: str) -> list[str]:
    """The tags of an If-None-Match header (weak ones compared as strong: the body is ours)."""
    return [tag.strip().removeprefix("W/") for tag in header.split(",")]


async def _updates(updates: Any) -> AsyncIterator[tuple[int, bool]]:
    try:
        async for update in updates:
            yield update.records_read, update.final
    finally:
        await updates.aclose()
