"""Figures as plain dicts: what the report's panels draw with, in the JSON the browser's Plotly takes.

The panels were written against plotly's figure API (``go.Bar``, ``make_subplots``,
``update_xaxes``...), whose validators, deep copies and subplot machinery were most of a
refresh's time at 100k trajectories. This module keeps that small part of the API and builds
the same JSON directly: a trace is a dict (``Node``: attribute access as plotly's objects
read, a missing key reads None), magic underscores nest (``marker_color`` is
``marker.color``), and ``make_subplots`` lays the grid out with plotly's own arithmetic
(domains, axis numbering, secondary y axes, subplot titles as annotations), so the page
draws what it drew before. Nothing here validates: a wrong key is Plotly.js's to ignore.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

__all__: list[str] = []


class Node(dict):
    """A dict read like a plotly object: ``t.marker.color``; a missing key is None."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = _node(value)

    def update(self, other: Any = (), **kw: Any) -> "Node":  # type: ignore[override]
        merge(self, {**dict(other), **kw})
        return self


def _node(value: Any) -> Any:
    if isinstance(value, dict) and not isinstance(value, Node):
        return Node((k, _node(v)) for k, v in value.items())
    return value


def expand(kw: dict[str, Any]) -> dict[str, Any]:
    """Magic underscores as plotly reads them: ``title_text="a"`` is ``{"title": {"text": "a"}}``."""
    out: dict[str, Any] = {}
    for key, value in kw.items():
        if value is None:
            continue
        path = key.split("_")
        at = out
        for part in path[:-1]:
            at = at.setdefault(part, {})
        at[path[-1]] = expand(value) if isinstance(value, dict) else value
    return out


def merge(into: dict, new: dict) -> dict:
    """``new`` into ``into``, dicts merged key by key (plotly's ``update``)."""
    for key, value in expand(new).items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = _node(value)
    return into


def _trace(kind: str, args: tuple, kw: dict[str, Any]) -> Node:
    if args:  # plotly's positional ``arg``: a dict of properties
        kw = {**args[0], **kw}
    trace = Node(type=kind)
    merge(trace, kw)
    if isinstance(trace.get("text"), (list, tuple)):  # labels are text (plotly's coercion)
        trace["text"] = [None if v is None else str(v) for v in trace["text"]]
    if isinstance(trace.get("colorscale"), str):  # plotly's named scale, not plotly.js's of the same name
        trace["colorscale"] = _colorscale(trace["colorscale"])
    bar = trace.get("colorbar")
    if bar is not None and isinstance(bar.get("title"), str):
        bar["title"] = Node(text=bar["title"])
    return trace


def _colorscale(name: str) -> list[list[Any]]:
    from plotly.colors import get_colorscale

    return [[round(float(at), 12), color] for at, color in get_colorscale(name)]


def Bar(*args: Any, **kw: Any) -> Node:
    return _trace("bar", args, kw)


def Scatter(*args: Any, **kw: Any) -> Node:
    return _trace("scatter", args, kw)


def Heatmap(*args: Any, **kw: Any) -> Node:
    return _trace("heatmap", args, kw)


def Histogram(*args: Any, **kw: Any) -> Node:
    return _trace("histogram", args, kw)


class Figure:
    """``data`` (traces) and ``layout``; ``make_subplots`` gives it a grid of axes."""

    def __init__(self, data: Any = None, layout: dict[str, Any] | None = None) -> None:
        self.data: list[Node] = []
        self.layout = Node()
        self._grid: list[list[tuple[tuple[str, str], ...]]] | None = None  # [row][col] -> ((x, y), (x, y2)?)
        if data is not None:
            for trace in (data if isinstance(data, (list, tuple)) else [data]):
                self.add_trace(trace)
        if layout:
            merge(self.layout, layout)

    # -- traces ----------------------------------------------------------------------

    def add_trace(self, trace: dict, row: int | None = None, col: int | None = None,
                  secondary_y: bool | None = None) -> "Figure":
        trace = trace if isinstance(trace, Node) else _node(dict(trace))
        if self._grid is not None and (row is not None or secondary_y is not None):
            refs = self._grid[(row or 1) - 1][(col or 1) - 1]
            if secondary_y and len(refs) < 2:
                raise ValueError(f"subplot ({row}, {col}) has no secondary y axis")
            x, y = refs[1 if secondary_y else 0]
            trace["xaxis"], trace["yaxis"] = x, y
        self.data.append(trace)
        return self

    # -- layout ----------------------------------------------------------------------

    def update_layout(self, **kw: Any) -> "Figure":
        merge(self.layout, kw)
        return self

    def _axes(self, letter: str, row: int | None, col: int | None, secondary_y: bool | None) -> list[str]:
        """The layout keys of the ``letter`` axes in (row, col) (None: every row or column)."""
        if self._grid is None:
            return [f"{letter}axis"]
        names: list[str] = []
        for r, cells in enumerate(self._grid, 1):
            for c, refs in enumerate(cells, 1):
                if (row is not None and r != row) or (col is not None and c != col):
                    continue
                for k, (x, y) in enumerate(refs):
                    if letter == "y" and secondary_y is not None and bool(k) != bool(secondary_y):
                        continue
                    if letter == "x" and k:
                        continue  # a secondary y axis shares the cell's x axis
                    label = x if letter == "x" else y
                    names.append(f"{letter}axis{label[1:]}")
        return names

    def update_xaxes(self, row: int | None = None, col: int | None = None, **kw: Any) -> "Figure":
        for name in self._axes("x", row, col, None):
            merge(self.layout.setdefault(name, Node()), kw)
        return self

    def update_yaxes(self, row: int | None = None, col: int | None = None, secondary_y: bool | None = None,
                     **kw: Any) -> "Figure":
        for name in self._axes("y", row, col, secondary_y):
            merge(self.layout.setdefault(name, Node()), kw)
        return self

    def axes_of(self, row: int, col: int) -> tuple[str, str]:
        """The (x, y) axis labels of subplot (row, col): ``("x2", "y2")``."""
        if self._grid is None:
            return ("x", "y")
        return self._grid[row - 1][col - 1][0]

    def add_vline(self, x: float, row: int | None = None, col: int | None = None, **kw: Any) -> "Figure":
        """A vertical line across the subplot's height at ``x`` (``line_*`` its style; ``annotation_text``:
        a label at its top right)."""
        xref, yref = self.axes_of(row or 1, col or 1)
        shape = {k: v for k, v in kw.items() if not k.startswith("annotation_")}
        line = Node(type="line", x0=x, x1=x, xref=xref, y0=0, y1=1, yref=f"{yref} domain")
        merge(line, shape)
        self.layout.setdefault("shapes", []).append(line)
        text = kw.get("annotation_text")
        if text is not None:
            self.layout.setdefault("annotations", []).append(Node(
                showarrow=False, text=text, x=x, xanchor="left", xref=xref, y=1, yanchor="top", yref=f"{yref} domain"))
        return self

    def to_plotly_json(self) -> dict[str, Any]:
        return {"data": self.data, "layout": self.layout}


def make_subplots(rows: int = 1, cols: int = 1, *, specs: Sequence[Sequence[dict | None]] | None = None,
                  subplot_titles: Iterable[str] | None = None, column_widths: Sequence[float] | None = None,
                  horizontal_spacing: float | None = None, vertical_spacing: float | None = None) -> Figure:
    """A grid of (x, y) subplots, laid out as ``plotly.subplots.make_subplots`` lays it out (its
    defaults: spacing, the room a secondary y axis takes, titles over each cell; top-left first)."""
    specs = [[None if s is None else {"secondary_y": False, **s} for s in spec_row]
             for spec_row in (specs or [[{} for _ in range(cols)] for _ in range(rows)])]
    rows, cols = len(specs), len(specs[0])
    secondary = any(s and s["secondary_y"] for spec_row in specs for s in spec_row)
    if horizontal_spacing is None:
        horizontal_spacing = (0.4 if secondary else 0.2) / cols
    if vertical_spacing is None:
        vertical_spacing = (0.5 if subplot_titles is not None else 0.3) / rows
    max_width = 0.94 if secondary else 1.0
    if column_widths is None:
        widths = [(max_width - horizontal_spacing * (cols - 1)) / cols] * cols
    else:
        total = float(sum(column_widths))
        widths = [(max_width - horizontal_spacing * (cols - 1)) * (w / total) for w in column_widths]
    heights = [(1.0 - vertical_spacing * (rows - 1)) / rows] * rows
    # the top row first: its y starts highest
    starts = [[(sum(widths[:c]) + c * horizontal_spacing, sum(heights[:r]) + r * vertical_spacing)
               for c in range(cols)] for r in range(rows)[::-1]]
    fig = Figure()
    grid: list[list[tuple[tuple[str, str], ...]]] = []
    domains: list[tuple[list[float], list[float]]] = []
    nx = ny = 0
    for r, spec_row in enumerate(specs):
        cells: list[tuple[tuple[str, str], ...]] = []
        for c, spec in enumerate(spec_row):
            if spec is None:
                cells.append(())
                continue
            x0 = starts[r][c][0] + 0.0
            x_domain = [x0, starts[r][c][0] + widths[c] - 0.0]
            y0 = starts[r][c][1] + 0.0
            y_domain = [min(max(y0, 0.0), 1.0), min(max(starts[r][c][1] + heights[-1 - r] - 0.0, 0.0), 1.0)]
            domains.append((x_domain, y_domain))
            nx, ny = nx + 1, ny + 1
            x, y = f"x{nx if nx > 1 else ''}", f"y{ny if ny > 1 else ''}"
            fig.layout[f"xaxis{x[1:]}"] = Node(domain=x_domain, anchor=y)
            fig.layout[f"yaxis{y[1:]}"] = Node(domain=y_domain, anchor=x)
            refs: tuple[tuple[str, str], ...] = ((x, y),)
            if spec["secondary_y"]:
                ny += 1
                fig.layout[f"yaxis{ny}"] = Node(anchor=x, overlaying=y, side="right")
                refs = ((x, y), (x, f"y{ny}"))
            cells.append(refs)
        grid.append(cells)
    fig._grid = grid
    titles = list(subplot_titles or ())
    notes = [Node(y=y_domain[1], xref="paper", x=sum(x_domain) / 2.0, yref="paper", text=title, showarrow=False,
                  font=Node(size=16), xanchor="center", yanchor="bottom")
             for title, (x_domain, y_domain) in zip(titles, domains) if title]
    if notes:
        fig.layout["annotations"] = notes
    return fig
