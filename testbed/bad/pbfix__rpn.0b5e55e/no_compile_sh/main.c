/* bad variant `no_compile_sh`: a correct program, but the submission has no compile.sh. */
/* Known-good rpn, written from the docs (not from the reference): a hand-written scanner
 * over each expression, a growable stack, status codes per the man page (2 error, 3 fatal). */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double *v;
    size_t n, cap;
} Stack;

enum { GOOD = 0, BAD = 2, FATAL = 3 };

static void push(Stack *s, double x) {
    if (s->n == s->cap) {
        s->cap = s->cap ? s->cap * 2 : 16;
        s->v = realloc(s->v, s->cap * sizeof *s->v);
        if (!s->v) { perror("rpn"); exit(BAD); }
    }
    s->v[s->n++] = x;
}

static int need(const Stack *s, size_t k, const char *word) {
    if (s->n >= k) return 1;
    fprintf(stderr, "rpn: stack underflow at '%s'\n", word);
    return 0;
}

static int numeric(const char *w, double *x) {
    const char *d = w + (*w == '-' || *w == '+');
    if (!(isdigit((unsigned char)d[0]) || (d[0] == '.' && isdigit((unsigned char)d[1])))) return 0;
    char *end;
    *x = strtod(w, &end);
    return *end == 0;
}

static int word(Stack *s, const char *w) {
    double x;
    if (numeric(w, &x)) { push(s, x); return GOOD; }
    if (!strcmp(w, "dup")) { if (!need(s, 1, w)) return BAD; push(s, s->v[s->n - 1]); return GOOD; }
    if (!strcmp(w, "neg")) { if (!need(s, 1, w)) return BAD; s->v[s->n - 1] *= -1; return GOOD; }
    if (w[0] && !w[1] && strchr("+-*/", w[0])) {
        if (!need(s, 2, w)) return BAD;
        double rhs = s->v[--s->n], *lhs = &s->v[s->n - 1];
        if (w[0] == '+') *lhs += rhs;
        if (w[0] == '-') *lhs -= rhs;
        if (w[0] == '*') *lhs *= rhs;
        if (w[0] == '/') {
            if (rhs == 0) { fputs("rpn: division by zero\n", stderr); return FATAL; }
            *lhs /= rhs;
        }
        return GOOD;
    }
    fprintf(stderr, "rpn: unknown token '%s'\n", w);
    return BAD;
}

/* Scan whitespace-separated words of text into the stack; *words counts them. */
static int scan(Stack *s, const char *text, int *words) {
    char w[512];
    while (*text) {
        while (isspace((unsigned char)*text)) text++;
        size_t len = 0;
        while (*text && !isspace((unsigned char)*text)) {
            if (len + 1 < sizeof w) w[len++] = *text;
            text++;
        }
        if (!len) break;
        w[len] = 0;
        ++*words;
        int rc = word(s, w);
        if (rc) return rc;
    }
    return GOOD;
}

static int result(Stack *s) {
    if (s->n != 1) { fprintf(stderr, "rpn: %zu values left on the stack\n", s->n); return BAD; }
    printf("%.12g\n", s->v[0] == 0 ? 0.0 : s->v[0]);
    fflush(stdout);
    return GOOD;
}

int main(int argc, char **argv) {
    Stack s = {0};
    int words = 0, rc = GOOD;
    if (argc > 1) {
        for (int i = 1; i < argc && rc == GOOD; i++) rc = scan(&s, argv[i], &words);
        return rc ? rc : result(&s);
    }
    int worst = GOOD;
    size_t cap = 256, len = 0;
    char *line = malloc(cap);
    for (int c = 0; c != EOF;) {
        len = 0;
        while ((c = getchar()) != EOF && c != '\n') {
            if (len + 2 > cap) line = realloc(line, cap *= 2);
            line[len++] = (char)c;
        }
        if (c == EOF && len == 0) break;
        line[len] = 0;
        s.n = 0, words = 0;
        rc = scan(&s, line, &words);
        if (rc == GOOD && words) rc = result(&s);
        if (rc == FATAL) return FATAL;
        if (rc) worst = BAD;
    }
    return worst;
}
