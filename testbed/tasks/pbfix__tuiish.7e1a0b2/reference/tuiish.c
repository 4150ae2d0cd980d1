/* tuiish: the reference implementation of the pbfix__tuiish fixture.
 * tuiish [TITLE]
 * stdout not a terminal: print a plain menu and exit 0.
 * stdout a terminal: alternate screen, a frame as large as TIOCGWINSZ says, keys from
 * stdin in raw mode (j/k move, q or EOF quits), terminal restored on exit.
 * (The reference ignores SIGWINCH: the fixture's ignored "gold_fail" test relies on it.) */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

static const char *items[] = {"alpha", "beta", "gamma"};
#define NITEMS 3

static char screen[1 << 16];
static size_t used;

static void put(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void put(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(screen + used, sizeof screen - used, fmt, ap);
    va_end(ap);
    if (n > 0) used += (size_t)n < sizeof screen - used ? (size_t)n : sizeof screen - used - 1;
}

static void flush_screen(void) {
    size_t off = 0;
    while (off < used) {
        ssize_t n = write(STDOUT_FILENO, screen + off, used - off);
        if (n <= 0) break;
        off += (size_t)n;
    }
    used = 0;
}

/* One row: left edge, text padded/cut to the inner width, right edge. */
static void row(int y, int cols, const char *text) {
    int inner = cols - 2;
    put("\x1b[%d;1H|%-*.*s|", y, inner, inner, text);
}

static void draw(int cols, int rows, const char *title, int sel) {
    char line[512];
    put("\x1b[H\x1b[2J");
    /* top border with the title centred in it */
    int tlen = (int)strlen(title) + 2;
    if (tlen > cols - 4) tlen = cols - 4;
    int left = (cols - 2 - tlen) / 2;
    put("\x1b[1;1H+");
    for (int i = 0; i < left; i++) put("-");
    put(" %.*s ", tlen - 2, title);
    for (int i = left + tlen; i < cols - 2; i++) put("-");
    put("+");
    snprintf(line, sizeof line, " size: %dx%d", cols, rows);
    row(2, cols, line);
    row(3, cols, "");
    for (int y = 4; y <= rows - 1; y++) {
        int idx = y - 4;
        if (idx < NITEMS)
            snprintf(line, sizeof line, " %s %s", idx == sel ? ">" : " ", items[idx]);
        else
            line[0] = '\0';
        if (y == rows - 1) snprintf(line, sizeof line, " q: quit  j/k: move");
        row(y, cols, line);
    }
    put("\x1b[%d;1H+", rows);
    for (int i = 0; i < cols - 2; i++) put("-");
    put("+");
    flush_screen();
}

int main(int argc, char **argv) {
    const char *title = argc > 1 ? argv[1] : "tuiish";
    if (!isatty(STDOUT_FILENO)) {
        printf("== %s ==\n", title);
        for (int i = 0; i < NITEMS; i++) printf("  %s\n", items[i]);
        return 0;
    }
    struct winsize ws;
    int cols = 80, rows = 24;
    if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 && ws.ws_row > 0) {
        cols = ws.ws_col;
        rows = ws.ws_row;
    }
    if (cols > 500) cols = 500;
    if (cols < 24) cols = 24;
    if (rows < 8) rows = 8;

    struct termios saved, raw;
    int have_termios = tcgetattr(STDIN_FILENO, &saved) == 0;
    if (have_termios) {
        raw = saved;
        cfmakeraw(&raw);
        tcsetattr(STDIN_FILENO, TCSANOW, &raw);
    }
    put("\x1b[?1049h\x1b[?25l");
    int sel = 0;
    draw(cols, rows, title, sel);
    char c;
    while (read(STDIN_FILENO, &c, 1) == 1 && c != 'q') {
        if (c == 'j' && sel < NITEMS - 1) sel++;
        else if (c == 'k' && sel > 0) sel--;
        else continue;
        draw(cols, rows, title, sel);
    }
    if (have_termios) tcsetattr(STDIN_FILENO, TCSANOW, &saved);
    put("\x1b[?25h\x1b[?1049l");
    flush_screen();
    return 0;
}
