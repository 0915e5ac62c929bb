"""Pictures of how the tile programs are laid out, drawn as SVG by string building.

Four pictures, each placed on the page where it explains best:

- layout_chunks.svg (stage 1): a sequence cut into chunks of C tokens, the state passed from chunk
  to chunk;
- layout_grid.svg (stage 1): the grid of programs, d_v / block_dv by B*H, each program owning a
  d_k x block_dv slice of the state;
- layout_wy_blocks.svg (stage 3): one chunk's C x C strictly lower L, T = (I + L)^{-1}, and
  [K e^gamma | V] solved together;
- layout_anchors.svg (stage 5): the 16-row sub-blocks of the scores, the diagonal blocks anchored at
  their middle row, the off-diagonal slabs at the first row below them.

Each picture has its own white card and dark ink, so it reads the same in the light and the dark
theme; the colours are mid-tones that stay apart for colour-blind readers (blue, orange, grey).
No dates, no random numbers: the same code writes the same bytes.
"""

from html import escape

INK = "#1f2328"
MUTED = "#6e7781"
GRID = "#afb8c1"
BLUE = "#4e79a7"
BLUE_LIGHT = "#c6d7ea"
ORANGE = "#f28e2b"
ORANGE_LIGHT = "#fbd5ae"
GREY_LIGHT = "#eaeef2"
FONT = "font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif"


class Drawing:
    """An SVG canvas with a white card behind everything; coordinates in px."""

    def __init__(self, width, height, title):
        self.width, self.height, self.title = width, height, title
        self.items = []

    def rect(self, x, y, w, h, fill="none", stroke=INK, width=1.0, dash=None):
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" fill="{fill}" '
                          f'stroke="{stroke}" stroke-width="{width:g}"{dashed}/>')

    def line(self, x1, y1, x2, y2, stroke=INK, width=1.0, arrow=False, dash=None):
        end = ' marker-end="url(#arrow)"' if arrow else ""
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<line x1="{x1:g}" y1="{y1:g}" x2="{x2:g}" y2="{y2:g}" stroke="{stroke}" '
                          f'stroke-width="{width:g}"{dashed}{end}/>')

    def circle(self, x, y, r, fill=INK):
        self.items.append(f'<circle cx="{x:g}" cy="{y:g}" r="{r:g}" fill="{fill}"/>')

    def text(self, x, y, words, size=13, anchor="middle", fill=INK, weight="normal", italic=False):
        style = ' font-style="italic"' if italic else ""
        self.items.append(f'<text x="{x:g}" y="{y:g}" font-size="{size}" text-anchor="{anchor}" '
                          f'fill="{fill}" font-weight="{weight}"{style}>{escape(words)}</text>')

    def svg(self):
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}" role="img" style="{FONT}">')
        defs = ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{INK}"/>'
                '</marker></defs>')
        card = (f'<rect x="0.5" y="0.5" width="{self.width - 1}" height="{self.height - 1}" rx="8" '
                f'fill="#ffffff" stroke="{GRID}"/>')
        return "\n".join([head, f"<title>{escape(self.title)}</title>", defs, card, *self.items, "</svg>"]) + "\n"


def chunks_over_the_sequence():
    """Tokens 1..N in chunks of C; each chunk reads the state the earlier ones left, then adds to it."""
    d = Drawing(760, 250, "A sequence in chunks of C tokens, the state passed from chunk to chunk")
    chunks, C, cell, x0, y0 = 4, 4, 34, 40, 70
    d.text(x0, 28, "tokens t = 1 ... N, in chunks of C (here C = 4): chunk [i] holds tokens iC + 1 ... (i + 1)C",
           anchor="start", size=13)
    gap = 40
    width = C * cell
    for i in range(chunks):
        left = x0 + i * (width + gap)
        for r in range(C):
            d.rect(left + r * cell, y0, cell, cell, fill=BLUE_LIGHT, stroke=BLUE)
            d.text(left + r * cell + cell / 2, y0 + 22, str(i * C + r + 1), size=12)
        d.rect(left, y0, width, cell, stroke=INK, width=2)
        d.text(left + width / 2, y0 - 8, f"chunk [{i}]", size=13, weight="bold")
        # the state the chunk reads (before it) and the one it leaves
        box_y = y0 + 90
        d.rect(left + 18, box_y, width - 36, 34, fill=ORANGE_LIGHT, stroke=ORANGE, width=1.5)
        d.text(left + width / 2, box_y + 22, f"state S[{i}]", size=12)
        d.line(left + width / 2, box_y, left + width / 2, y0 + cell + 4, arrow=True)
        if i + 1 < chunks:
            d.line(left + width - 18, box_y + 17, left + width + gap + 18, box_y + 17, stroke=ORANGE,
                   width=2.5, arrow=True)
    d.text(x0, 220, "Inside a chunk: O[i] = Q[i] S[i]^T + (Q[i] K[i]^T ⊙ M) V[i], the mask M inclusive (j ≤ r).",
           anchor="start", size=12)
    d.text(x0, 238, "Between chunks (orange): S[i+1]^T = S[i]^T + K[i]^T V[i], after the chunk's output has read S[i].",
           anchor="start", size=12, fill=INK)
    return d.svg()


def grid_of_programs():
    """The grid: d_v / block_dv programs along x, B*H along y; each owns a d_k x block_dv state slice."""
    d = Drawing(760, 360, "The grid of programs: d_v / block_dv by B*H, each with its own slice of the state")
    nx, ny, cw, ch, x0, y0 = 4, 3, 70, 46, 70, 62
    d.text(x0, 28, "T.Kernel(d_v / block_dv, B·H): one program (thread block) per cell; programs share nothing",
           anchor="start", size=13)
    for j in range(ny):
        for i in range(nx):
            owner = (i, j) == (1, 1)
            d.rect(x0 + i * cw, y0 + j * ch, cw, ch, fill=ORANGE_LIGHT if owner else BLUE_LIGHT,
                   stroke=ORANGE if owner else BLUE, width=2 if owner else 1)
            d.text(x0 + i * cw + cw / 2, y0 + j * ch + 28, f"({i}, {j})", size=12)
    d.text(x0 + nx * cw / 2, y0 + ny * ch + 22, "i_v: block of value columns (grid x)", size=12)
    d.text(x0 - 14, y0 + ny * ch / 2, "i_bh", size=12, anchor="end")
    d.text(x0 - 14, y0 + ny * ch / 2 + 15, "(grid y)", size=11, anchor="end", fill=MUTED)
    # one program's state slice, on the right
    sx, sy, sw, sh = 470, 62, 240, 180
    blocks = 4
    for c in range(blocks):
        mine = c == 1
        d.rect(sx + c * sw / blocks, sy, sw / blocks, sh, fill=ORANGE_LIGHT if mine else GREY_LIGHT,
               stroke=ORANGE if mine else GRID, width=2 if mine else 1)
    d.rect(sx, sy, sw, sh, stroke=INK, width=1.5)
    d.text(sx + sw / 2, sy - 10, "the state S^T of one (batch, head): d_k × d_v", size=12)
    d.text(sx - 8, sy + sh / 2, "d_k", size=12, anchor="end")
    d.text(sx + 1.5 * sw / blocks, sy + sh + 18, "block_dv", size=12)
    d.text(sx + sw / 2, sy + sh + 38, "program (1, 1) owns this d_k × block_dv slice,", size=12)
    d.text(sx + sw / 2, sy + sh + 54, "on chip for the whole chunk loop", size=12)
    d.line(x0 + 2 * cw, y0 + 1.5 * ch, sx + 1.5 * sw / blocks, sy + sh / 2, stroke=ORANGE, width=1.5,
           arrow=True, dash="5 4")
    d.text(x0, 330, "Column c of the output needs column c of V and of the state only, so the value columns split",
           anchor="start", size=12)
    d.text(x0, 347, "across programs; the keys (d_k) do not: every program reads all of Q and K of its (batch, head).",
           anchor="start", size=12)
    return d.svg()


def wy_ut_blocks():
    """Stage 3's chunk system: L strictly lower, T = (I + L)^{-1}, T applied to [K e^gamma | V] at once."""
    d = Drawing(780, 300, "One chunk's triangular system: L, T = (I + L)^{-1}, and [K e^gamma | V] solved together")
    n, cell, y0 = 8, 18, 70
    size = n * cell

    def triangle(x, strict, fill, stroke, label, note):
        for r in range(n):
            for c in range(n):
                inside = c < r if strict else c <= r
                d.rect(x + c * cell, y0 + r * cell, cell, cell, fill=fill if inside else "#ffffff",
                       stroke=GRID, width=0.5)
                if not strict and c == r:
                    d.text(x + c * cell + cell / 2, y0 + r * cell + 13, "1", size=10)
        d.rect(x, y0, size, size, stroke=INK, width=1.5)
        d.text(x + size / 2, y0 - 28, label, size=14, weight="bold")
        d.text(x + size / 2, y0 - 10, note, size=11, fill=MUTED)

    triangle(40, True, BLUE_LIGHT, BLUE, "L  (C × C)", "strictly lower: i < c")
    d.text(40 + size / 2, y0 + size + 22, "L[c, i] = β_i A^kk[c, i], i < c", size=12)
    d.text(40 + size + 30, y0 + size / 2 + 5, "→", size=22)
    triangle(250, False, ORANGE_LIGHT, ORANGE, "T = (I + L)⁻¹", "unit lower, by substitution")
    d.text(250 + size / 2, y0 + size + 22, "row c needs the rows above it", size=12)
    d.text(250 + size + 28, y0 + size / 2 + 5, "×", size=20)
    # the right-hand side [K e^gamma | V], one block of columns each, with beta on the rows
    x = 470
    dk, dv = 4 * cell, 5 * cell
    d.rect(x, y0, dk, size, fill=BLUE_LIGHT, stroke=BLUE, width=1.5)
    d.rect(x + dk, y0, dv, size, fill=ORANGE_LIGHT, stroke=ORANGE, width=1.5)
    d.text(x + dk / 2, y0 + size / 2, "K ⊙ e^γ", size=12)
    d.text(x + dk + dv / 2, y0 + size / 2, "V", size=12)
    d.text(x + (dk + dv) / 2, y0 - 28, "[K ⊙ e^γ | V]", size=14, weight="bold")
    d.text(x + (dk + dv) / 2, y0 - 10, "C × (d_k + d_v), one right-hand side", size=11, fill=MUTED)
    d.text(x + dk / 2, y0 + size + 22, "→ W", size=12)
    d.text(x + dk + dv / 2, y0 + size + 22, "→ U", size=12)
    d.text(40, 268, "W = Diag(β) T (K ⊙ e^γ) and U = Diag(β) T V share T: one substitution on the C × (d_k + d_v)",
           anchor="start", size=12)
    d.text(40, 286, "right-hand side [K ⊙ e^γ | V] serves both, its two column blocks side by side.",
           anchor="start", size=12)
    return d.svg()


def sub_block_anchors():
    """Stage 5's scores of one chunk: 16-row sub-blocks, diagonal blocks at their middle row, slabs below."""
    C, sub = 64, 16
    px = 4  # pixels per row
    size = C * px
    x0, y0 = 70, 60
    d = Drawing(800, 380, "Stage 5's sub-block anchors in one chunk's C x C scores")
    d.text(x0, 28, f"The C × C scores of one chunk (C = {C}), in {sub}-row sub-blocks; row c, column i; only i ≤ c is kept",
           anchor="start", size=13)
    d.rect(x0, y0, size, size, fill="#ffffff", stroke=INK, width=1.5)
    blocks = C // sub
    for p in range(blocks):
        for q in range(blocks):
            bx, by = x0 + q * sub * px, y0 + p * sub * px
            if q == p:
                d.rect(bx, by, sub * px, sub * px, fill=BLUE_LIGHT, stroke=BLUE, width=1.5)
            elif q > p:
                d.rect(bx, by, sub * px, sub * px, fill=GREY_LIGHT, stroke=GRID, width=0.5)
    for q in range(blocks - 1):  # one slab per column block: the rows below its diagonal block
        bx, by = x0 + q * sub * px, y0 + (q + 1) * sub * px
        d.rect(bx, by, sub * px, size - (q + 1) * sub * px, fill=ORANGE_LIGHT, stroke=ORANGE, width=1.5)
    for p in range(blocks):  # diagonal anchors: the middle row of each sub-block
        m = p * sub + sub // 2
        d.line(x0 + p * sub * px, y0 + m * px, x0 + (p + 1) * sub * px, y0 + m * px, stroke=BLUE,
               width=2.5)
        d.circle(x0 + p * sub * px + sub * px / 2, y0 + m * px, 3.5, fill=BLUE)
    for q in range(blocks - 1):  # slab anchors: the first row below the slab's columns
        s0 = (q + 1) * sub
        d.line(x0 + q * sub * px, y0 + s0 * px, x0 + (q + 1) * sub * px, y0 + s0 * px, stroke=INK,
               width=2.5, dash="5 3")
    d.text(x0 + size / 2, y0 + size + 20, "column i (keys)", size=12)
    d.text(x0 - 10, y0 + size / 2, "row c", size=12, anchor="end")
    for p in range(blocks + 1):
        d.text(x0 - 6, y0 + p * sub * px + 4, str(p * sub), size=10, anchor="end", fill=MUTED)
    lx = x0 + size + 40
    d.rect(lx, 70, 22, 16, fill=BLUE_LIGHT, stroke=BLUE, width=1.5)
    d.text(lx + 32, 83, "diagonal sub-block: one C × C GEMM, block diagonal kept", anchor="start", size=12)
    d.line(lx, 112, lx + 22, 112, stroke=BLUE, width=2.5)
    d.circle(lx + 11, 112, 3.5, fill=BLUE)
    d.text(lx + 32, 116, "its anchor m: the middle row of the sub-block;", anchor="start", size=12)
    d.text(lx + 32, 132, "factors at most a_min^(−8) either way", anchor="start", size=12)
    d.rect(lx, 152, 22, 16, fill=ORANGE_LIGHT, stroke=ORANGE, width=1.5)
    d.text(lx + 32, 165, "off-diagonal slab: 16 key columns, every row below", anchor="start", size=12)
    d.text(lx + 32, 181, "them, one C × 16 GEMM", anchor="start", size=12)
    d.line(lx, 204, lx + 22, 204, width=2.5, dash="5 3")
    d.text(lx + 32, 208, "its anchor m = s0: the first row below the slab's", anchor="start", size=12)
    d.text(lx + 32, 224, "columns; γ never increases, so e^(γ_c − γ_m) ≤ 1", anchor="start", size=12)
    d.text(lx + 32, 240, "and e^(γ_m − γ_i) ≤ 1", anchor="start", size=12)
    d.rect(lx, 262, 22, 16, fill=GREY_LIGHT, stroke=GRID, width=0.5)
    d.text(lx + 32, 275, "above the diagonal: not computed (i > c)", anchor="start", size=12)
    return d.svg()


PICTURES = {
    "docs/generated/layout_chunks.svg": chunks_over_the_sequence,
    "docs/generated/layout_grid.svg": grid_of_programs,
    "docs/generated/layout_wy_blocks.svg": wy_ut_blocks,
    "docs/generated/layout_anchors.svg": sub_block_anchors,
}


def _writer(draw):
    def write(path):
        path.write_text(draw(), encoding="utf-8")
    return write


def generated_files():
    """{path relative to the repository: writer}: the four layout pictures."""
    return {path: _writer(draw) for path, draw in PICTURES.items()}
