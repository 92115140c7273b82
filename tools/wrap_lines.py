"""Wrap the lines of Python files that are longer than 110 characters, keeping what the code means.

`python tools/wrap_lines.py FILE...` rewrites each file in place, one long line at a time, and prints the lines
it left (a code template inside a string, an expression with no bracket to break in): those are for a person.
A line is broken only where Python allows it without a backslash: after a comma or an opening bracket, before
`and`/`or`/`if`/`for`, between two pieces of a string. A comment too long for its line goes above it, wrapped; a
docstring is wrapped at its words. Each change is checked: the file still parses, and its syntax tree is the same
(a docstring's text aside)."""
import ast, io, sys, textwrap, tokenize
from pathlib import Path

WIDTH = 110
OPEN,CLOSE = '([{', ')]}'
BEFORE = {'and', 'or', 'if', 'else', 'for', 'in'}  # an expression may break before these (inside brackets)
COMPOUND = ('def ', 'async def ', 'if ', 'elif ', 'for ', 'while ', 'with ', 'class ')

def all_lines(text):
    "The line numbers of the `__all__ = [...]` statement nbdev writes (nbdev wraps it, at 120 characters)"
    return {n for node in ast.parse(text).body if isinstance(node, ast.Assign)
            and any(getattr(t, 'id', None) == '__all__' for t in node.targets)
            for n in range(node.lineno, node.end_lineno + 1)}

def is_long(line): return len(line) > WIDTH

def tokens_of(text): return list(tokenize.generate_tokens(io.StringIO(text).readline))

def wrap_text(text, first, rest):
    return textwrap.wrap(text, width=WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False) or [first.rstrip()]

def lead_of(line): return line[:len(line) - len(line.lstrip())]

def bullet_pad(text):
    for mark in ('- ', '* ', '1. ', '2. ', '3. ', '4. ', '5. ', '6. ', '7. ', '8. ', '9. '):
        if text.startswith(mark): return ' ' * len(mark)
    return ''

def depths(toks):
    "For each token, the stack of the brackets open before it (their tokens)"
    stack,out = [],[]
    for t in toks:
        out.append(tuple(stack))
        if t.type == tokenize.OP and t.string in OPEN: stack.append(t)
        elif t.type == tokenize.OP and t.string in CLOSE and stack: stack.pop()
    return out

def statement_lead(lines, toks, stacks, k):
    "The indentation of the logical line that token `k` belongs to"
    while k > 0 and stacks[k]: k -= 1
    return lead_of(lines[toks[k].start[0] - 1])

def hanging(lines, toks, stacks, k):
    lead = statement_lead(lines, toks, stacks, k)
    first = lines[toks[next(j for j in range(k, -1, -1) if not stacks[j])].start[0] - 1].lstrip()
    return lead + (' ' * 8 if first.startswith(COMPOUND) else ' ' * 4)

def docstring_like(toks, k):
    "A string token that is a statement alone: a docstring (or a bare string), whose text may be rewrapped"
    skip = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
    j = k - 1
    while j >= 0 and toks[j].type in skip: j -= 1
    before_ok = j < 0 or toks[j].type == tokenize.NEWLINE or (toks[j].type == tokenize.OP
                                                              and toks[j].string == ':'
                                                             and toks[j].end[0] == toks[k].start[0])
    nxt = toks[k + 1] if k + 1 < len(toks) else None
    return before_ok and nxt is not None and nxt.type in (tokenize.NEWLINE, tokenize.ENDMARKER)

def fix_in_string(lines, toks, k, i):
    "Line `i` lies in the multi-line string `toks[k]`: rewrap it if the string is a docstring"
    if not docstring_like(toks, k): return None
    line = lines[i]
    lead = lead_of(line)
    if i == toks[k].start[0] - 1: lead = ' ' * toks[k].start[1] if toks[k].start[1] else lead_of(line)
    body = line.strip()
    return wrap_text(body, lead_of(line), lead + bullet_pad(body))

def one_line_docstring(line, tok):
    "A one-line docstring too long for its line, as a triple-quoted one wrapped at its words"
    s = tok.string
    q = next(i for i,c in enumerate(s) if c in '\'"')
    prefix,quote = s[:q], s[q]
    body = s[q+1:-1]
    if s[q:q+3] == quote * 3 or quote * 3 in body or body.endswith(quote) or line[
            tok.end[1]:].strip(): return None
    before = line[:tok.start[1]]
    rest = lead_of(line) + ('    ' if before.strip() else '')
    return wrap_text(body + quote * 3, before + prefix + quote * 3, rest)

def fix_comment(lines, tok, i):
    line = lines[i]
    code = line[:tok.start[1]].rstrip()
    text = tok.string.lstrip('#').strip()
    if not code: return wrap_text(text, lead_of(line) + '# ', lead_of(line) + '# ')
    if len(code) + 2 + len(tok.string) <= WIDTH: return [f'{code}  {tok.string}']
    lead = lead_of(line)
    return wrap_text(text, lead + '# ', lead + '# ') + [code]

def string_splits(tok, stack):
    "Places to cut a one-line string token in two adjacent literals: `(column, first, second)`"
    s = tok.string
    q = next(i for i,c in enumerate(s) if c in '\'"')
    prefix,quote = s[:q], s[q]
    if s[q:q+3] in ('"""', "'''"): return []
    body,braces,out = s[q+1:-1], 0, []
    is_f = 'f' in prefix.lower()
    for j,c in enumerate(body):
        if is_f and c == '{': braces += 1
        elif is_f and c == '}': braces -= 1
        elif c == ' ' and braces == 0 and j > 0 and body[j-1] != '\\':
            first,second = body[:j+1], body[j+1:]
            if not second or second.startswith(' '): continue
            out.append((tok.start[1] + len(prefix) + 1 + j + 1 + 1,
                        f'{prefix}{quote}{first}{quote}', f'{prefix}{quote}{second}{quote}'))
    return out

HEADS = {'if', 'elif', 'else', 'for', 'while', 'with', 'try', 'except', 'finally', 'def'}

def compound_split(line, toks, stacks, on_line):
    "`if x: y` too long as `if x:` and `y` on a line of its own, when the header fits"
    first = toks[on_line[0]]
    if stacks[on_line[0]] or first.type != tokenize.NAME or first.string not in HEADS: return None
    for n,k in enumerate(on_line[:-1]):
        t = toks[k]
        if t.type == tokenize.OP and t.string == ':' and not stacks[k]:
            body = toks[on_line[n+1]]
            if body.type == tokenize.COMMENT or t.end[1] > WIDTH: return None
            return [line[:t.end[1]], lead_of(line) + '    ' + line[body.start[1]:]]
    return None

def closes_soon(toks, k, within=30):
    "Whether the bracket `toks[k]` opens closes on its line within `within` characters"
    depth = 0
    for t in toks[k:]:
        if t.start[0] != toks[k].start[0]: return False
        if t.type == tokenize.OP and t.string in OPEN: depth += 1
        elif t.type == tokenize.OP and t.string in CLOSE:
            depth -= 1
            if depth == 0: return t.start[1] - toks[k].end[1] <= within
    return False

def paren_wrap(line, toks, stacks, on_line):
    "Put brackets around the expression of a statement that has none to break in (`assert`, `=`, `return`)"
    first,last = toks[on_line[0]], toks[on_line[-1]]
    if stacks[on_line[0]] or toks[on_line[-1] + 1].type != tokenize.NEWLINE: return None
    start = None
    if first.type == tokenize.NAME and first.string in ('assert', 'return'): start = 1
    else: start = next((n + 1 for n,k in enumerate(on_line) if not stacks[k] and toks[k].type == tokenize.OP
                        and toks[k].string in ('=', '+=', '-=', '*=', '/=', '|=')), None)
    if start is None or start >= len(on_line): return None
    end = len(on_line)
    if first.string == 'assert':
        end = next((n for n in range(start, len(on_line)) if not stacks[on_line[n]]
                    and toks[on_line[n]].string == ','), len(on_line))
    a,b = toks[on_line[start]].start[1], toks[on_line[end - 1]].end[1]
    return [line[:a] + '(' + line[a:b] + ')' + line[b:]]

def fix_code(lines, toks, stacks, i):
    "Break code line `i` at the rightmost place that leaves its first part within the width"
    line = lines[i]
    skip = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    on_line = [k for k,t in enumerate(toks) if t.start[0] == i + 1 and t.type not in skip]
    split = compound_split(line, toks, stacks, on_line)
    if split: return split
    best = None          # (score, new lines)
    for n,k in enumerate(on_line):
        t,stack = toks[k], stacks[k]
        last = n == len(on_line) - 1
        after = toks[on_line[n+1]] if not last else None
        if t.type == tokenize.OP and t.string == ',' and stack and not last and t.end[1] <= WIDTH \
                and not (after.type == tokenize.OP and after.string in CLOSE):
            col = stack[-1].end[1] if stack[-1].start[0] == i + 1 else len(lead_of(line))
            indent = ' ' * col if col <= 70 else hanging(lines, toks, stacks, k)
            cand = (t.end[1] - 8 * len(stack), [line[:t.end[1]].rstrip(),
                                                indent + line[after.start[1]:].lstrip()])
        elif t.type == tokenize.OP and t.string in OPEN and not last and t.end[1] <= WIDTH \
                and not (after.type == tokenize.OP and after.string in CLOSE) and not closes_soon(toks, k):
            cand = (t.end[1] - 20 - 8 * len(stack), [line[:t.end[1]].rstrip(), hanging(lines, toks, stacks, k)
                                    + line[after.start[1]:].lstrip()])
        elif t.type == tokenize.NAME and t.string in BEFORE and stack and n > 0 and t.start[1] <= WIDTH:
            col = stack[-1].end[1] if stack[-1].start[0] == i + 1 else len(lead_of(line)) + 4
            indent = ' ' * col if col <= 70 else hanging(lines, toks, stacks, k)
            cand = (t.start[1] - 5 - 8 * len(stack), [line[:t.start[1]].rstrip(), indent + line[t.start[1]:]])
        elif t.type == tokenize.STRING and stack and t.start[0] == t.end[0] and t.end[1] > WIDTH - 10:
            cuts = [c for c in string_splits(t, stack) if c[0] <= WIDTH]
            if not cuts: continue
            col,first,second = cuts[-1]
            indent = ' ' * t.start[1] if t.start[1] <= 70 else hanging(lines, toks, stacks, k)
            cand = (col - 30, [line[:t.start[1]] + first, indent + second + line[t.end[1]:]])
        else: continue
        if len(cand[1][0]) <= WIDTH and (best is None or cand[0] > best[0]): best = cand
    return best[1] if best else paren_wrap(line, toks, stacks, on_line)

def fix_line(text, i):
    "New lines for line `i` of `text` (0-based), or `None` if this tool cannot wrap it"
    lines = text.split('\n')
    toks = tokens_of(text)
    stacks = depths(toks)
    for k,t in enumerate(toks):
        if t.type == tokenize.STRING and t.start[0] - 1 <= i <= t.end[0] - 1 and t.start[0] != t.end[0]:
            return fix_in_string(lines, toks, k, i), True
    for k,t in enumerate(toks):
        if t.type == tokenize.STRING and t.start[0] == i + 1 and docstring_like(toks, k):
            return one_line_docstring(lines[i], t), True
    comment = next((t for t in toks if t.type == tokenize.COMMENT and t.start[0] == i + 1), None)
    if comment is not None: return fix_comment(lines, comment, i), False
    return fix_code(lines, toks, stacks, i), False

def same_tree(a, b):
    return ast.dump(ast.parse(a)) == ast.dump(ast.parse(b))

def string_runs(toks):
    "Runs of string literals that Python joins, one a line: `[(first index, last index)]`"
    runs,k = [],0
    while k < len(toks):
        j = k
        while toks[j].type == tokenize.STRING and j + 2 < len(toks) and toks[j+1].type == tokenize.NL \
                and toks[j+2].type == tokenize.STRING: j += 2
        if j > k: runs.append((k, j))
        k = j + 1
    return runs

def split_body(body, is_f):
    "The places after which `body` may be cut: after a space outside `{}`"
    places,braces = [],0
    for j,c in enumerate(body):
        if is_f and c == '{': braces += 1
        elif is_f and c == '}': braces -= 1
        elif c == ' ' and braces == 0 and (j == 0 or body[j-1] != '\\'): places.append(j + 1)
    return places

def fill(body, places, widths):
    "Cut `body` greedily at `places` into pieces of at most `widths[i]` characters (the last width repeats)"
    pieces,start = [],0
    while start < len(body):
        w = widths[min(len(pieces), len(widths) - 1)]
        if len(body) - start <= w: pieces.append(body[start:]); break
        fits = [p for p in places if start < p <= start + w]
        cut = fits[-1] if fits else next((p for p in places if p > start), len(body))
        pieces.append(body[start:cut]); start = cut
    return pieces

def reflow_run(lines, toks, k, j):
    "The lines of the run of strings `toks[k..j]` filled again, or `None` when they cannot be or need not be"
    parts = [toks[n] for n in range(k, j + 1, 2)]
    if any(t.start[0] != t.end[0] for t in parts): return None
    if any(lines[t.start[0] - 1][:t.start[1]].strip() for t in parts[1:]): return None
    heads = []
    for t in parts:
        q = next(i for i,c in enumerate(t.string) if c in '\'"')
        if t.string[q:q+3] in ('"""', "'''"): return None
        heads.append((t.string[:q].lower(), t.string[q], t.string[q+1:-1]))
    if len({h[1] for h in heads}) != 1 or {h[0] for h in heads} - {'', 'f'}: return None
    is_f = any(h[0] == 'f' for h in heads)
    if is_f and any(h[0] == '' and ('{' in h[2] or '}' in h[2]) for h in heads): return None
    prefix,quote,body = 'f' if is_f else '', heads[0][1], ''.join(h[2] for h in heads)
    col,last = parts[1].start[1], parts[-1]
    tail = lines[last.start[0] - 1][last.end[1]:]
    room = len(prefix) + 2
    widths = [WIDTH - parts[0].start[1] - room, WIDTH - col - room]
    pieces = fill(body, split_body(body, is_f), widths)
    if len(pieces) > 1 and len(pieces[-1]) + len(tail) > widths[1]:
        pieces = fill(body, split_body(body, is_f), widths[:1] + [widths[1] - len(tail)])
    ragged = any(len(h[2]) < 0.4 * widths[1] for h in heads[:-1])
    if len(pieces) > len(parts) or len(pieces) == len(parts) and not ragged: return None
    if [h[2] for h in heads] == pieces: return None
    first = lines[parts[0].start[0] - 1][:parts[0].start[1]]
    new = [(first if n == 0 else ' ' * col) + f'{prefix}{quote}{piece}{quote}' for n,piece
           in enumerate(pieces)]
    new[-1] += tail
    return parts[0].start[0] - 1, last.start[0] - 1, new

def reflow_strings(text):
    "Fill again the runs of joined strings that wrapping left ragged (a piece of a few words on its own line)"
    skipped = set()
    for _ in range(2000):
        lines,toks = text.split('\n'), tokens_of(text)
        for k,j in string_runs(toks):
            if toks[k].start in skipped: continue
            found = reflow_run(lines, toks, k, j)
            if found is None: skipped.add(toks[k].start); continue
            a,b,new = found
            candidate = '\n'.join(lines[:a] + new + lines[b+1:])
            if any(is_long(l) for l in new) or not same_tree(text, candidate):
                skipped.add(toks[k].start); continue
            text = candidate
            break
        else: return text
    return text

def wrap_file(path):
    text,left,tried = Path(path).read_text(), [], []
    for _ in range(5000):
        lines = text.split('\n')
        todo = [i for i,l in enumerate(lines) if is_long(l) and l not in left and i + 1 not
                in all_lines(text)]
        if not todo: break
        i = todo[0]
        new,is_doc = fix_line(text, i)
        candidate = '\n'.join(lines[:i] + (new or []) + lines[i+1:])
        try: ok = new is not None and (is_doc and bool(ast.parse(candidate)) or same_tree(text, candidate))
        except SyntaxError: ok = False
        wrapped = len(new or []) == 1 and new[0].count('(') > lines[i].count('(') and lines[i] not in tried
        if ok and (len(new) > 1 or not is_long(new[0]) or wrapped):
            text = candidate
            if wrapped: tried.append(new[0])
        else: left.append(lines[i])
    Path(path).write_text(reflow_strings(text))
    return left

if __name__ == '__main__':
    for p in sys.argv[1:]:
        for line in wrap_file(p): print(f'{p}: {line.strip()[:100]}')
