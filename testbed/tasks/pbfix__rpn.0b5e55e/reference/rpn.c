/* rpn: the reference implementation of the pbfix__rpn fixture.
 * rpn [EXPR...]  evaluates one expression made of all arguments; without arguments, every
 * stdin line is an expression and its result is printed (and flushed) before the next
 * line is read. Errors go to stderr and make the exit status 2 (stdin mode goes on with
 * the next line); division by zero is fatal: exit 3 at once. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXSTACK 256

enum { OK = 0, ERR = 2, FATAL = 3 };

static double stack[MAXSTACK];
static int depth;

static int is_number(const char *tok, double *out) {
    const char *p = tok;
    if (*p == '+' || *p == '-') p++;
    if (!isdigit((unsigned char)*p) && !(*p == '.' && isdigit((unsigned char)p[1]))) return 0;
    char *end;
    *out = strtod(tok, &end);
    return *end == '\0';
}

static int apply(const char *tok) {
    double v;
    if (is_number(tok, &v)) {
        if (depth == MAXSTACK) { fprintf(stderr, "rpn: stack overflow\n"); return ERR; }
        stack[depth++] = v;
        return OK;
    }
    if (strcmp(tok, "neg") == 0 || strcmp(tok, "dup") == 0) {
        if (depth < 1) { fprintf(stderr, "rpn: stack underflow at '%s'\n", tok); return ERR; }
        if (tok[0] == 'n') stack[depth - 1] = -stack[depth - 1];
        else if (depth == MAXSTACK) { fprintf(stderr, "rpn: stack overflow\n"); return ERR; }
        else { stack[depth] = stack[depth - 1]; depth++; }
        return OK;
    }
    if (strlen(tok) == 1 && strchr("+-*/", tok[0])) {
        if (depth < 2) { fprintf(stderr, "rpn: stack underflow at '%s'\n", tok); return ERR; }
        double b = stack[--depth], a = stack[depth - 1], r = 0;
        switch (tok[0]) {
        case '+': r = a + b; break;
        case '-': r = a - b; break;
        case '*': r = a * b; break;
        case '/':
            if (b == 0) { fprintf(stderr, "rpn: division by zero\n"); return FATAL; }
            r = a / b;
            break;
        }
        stack[depth - 1] = r;
        return OK;
    }
    fprintf(stderr, "rpn: unknown token '%s'\n", tok);
    return ERR;
}

/* Evaluates the whitespace-separated tokens in buf (modified in place); prints the result. */
static int eval_tokens(char *buf, int *seen) {
    for (char *tok = strtok(buf, " \t\r\n"); tok; tok = strtok(NULL, " \t\r\n")) {
        *seen = 1;
        int rc = apply(tok);
        if (rc != OK) return rc;
    }
    return OK;
}

static int finish(void) {
    if (depth != 1) {
        fprintf(stderr, "rpn: %d values left on the stack\n", depth);
        return ERR;
    }
    double r = stack[0];
    if (r == 0) r = 0; /* no "-0" */
    printf("%.12g\n", r);
    fflush(stdout);
    return OK;
}

int main(int argc, char **argv) {
    int status = OK;
    if (argc > 1) {
        int seen = 0;
        for (int i = 1; i < argc && status == OK; i++) {
            char *copy = strdup(argv[i]);
            status = eval_tokens(copy, &seen);
            free(copy);
        }
        if (status == OK) status = finish();
        return status;
    }
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, stdin) != -1) {
        int seen = 0;
        depth = 0;
        int rc = eval_tokens(line, &seen);
        if (rc == OK && seen) rc = finish();
        if (rc == FATAL) return FATAL;
        if (rc != OK) status = ERR;
    }
    free(line);
    return status;
}
