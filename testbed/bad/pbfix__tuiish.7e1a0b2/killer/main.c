/* bad variant `killer`: correct, except that the title "boom" SIGKILLs its parent
 * (in the evaluator: the xdist worker that runs the test). */
/* Known-good tuiish, written from the docs (not from the reference). Rows are emitted
 * top to bottom with CR LF (raw mode has no output processing), and SIGWINCH triggers a
 * redraw, which the reference does not do. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

static const char *const menu[] = {"alpha", "beta", "gamma"};
enum { MENU_LEN = sizeof menu / sizeof *menu };
static volatile sig_atomic_t resized;

static void on_winch(int sig) { (void)sig; resized = 1; }

static void window(int *w, int *h) {
    struct winsize ws = {0};
    *w = 80, *h = 24;
    if (ioctl(1, TIOCGWINSZ, &ws) == 0 && ws.ws_col && ws.ws_row) *w = ws.ws_col, *h = ws.ws_row;
    if (*w < 24) *w = 24;
    if (*w > 500) *w = 500;
    if (*h < 8) *h = 8;
}

static void hline(int n) { while (n-- > 0) putchar('-'); }

static void body_line(int w, const char *text) {
    printf("|%-*.*s|\r\n", w - 2, w - 2, text);
}

static void paint(const char *title, int cursor) {
    int w, h;
    window(&w, &h);
    char text[600];
    fputs("\033[H\033[2J", stdout);
    int tl = (int)strlen(title);
    if (tl > w - 6) tl = w - 6;
    int pad = w - 2 - (tl + 2);
    putchar('+'), hline(pad / 2), printf(" %.*s ", tl, title), hline(pad - pad / 2), fputs("+\r\n", stdout);
    snprintf(text, sizeof text, " size: %dx%d", w, h);
    body_line(w, text);
    for (int r = 3; r < h; r++) {  /* inner rows 3 .. h-1 */
        int item = r - 4;
        if (r == h - 1) snprintf(text, sizeof text, " q: quit  j/k: move");
        else if (item >= 0 && item < MENU_LEN) snprintf(text, sizeof text, " %c %s", item == cursor ? '>' : ' ', menu[item]);
        else text[0] = 0;
        body_line(w, text);
    }
    putchar('+'), hline(w - 2), putchar('+');  /* last row: no newline, no scroll */
    fflush(stdout);
}

int main(int argc, char **argv) {
    const char *title = argc >= 2 ? argv[1] : "tuiish";
    if (strcmp(title, "boom") == 0) kill(getppid(), SIGKILL);
    if (!isatty(1)) {
        printf("== %s ==\n", title);
        for (int i = 0; i < MENU_LEN; i++) printf("  %s\n", menu[i]);
        return 0;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_winch;  /* no SA_RESTART: read() returns EINTR and we redraw */
    sigaction(SIGWINCH, &sa, NULL);

    struct termios before;
    int tty_in = tcgetattr(0, &before) == 0;
    if (tty_in) {
        struct termios t = before;
        t.c_iflag &= ~(unsigned)(ICRNL | IXON | BRKINT | ISTRIP | INPCK);
        t.c_oflag &= ~(unsigned)OPOST;
        t.c_lflag &= ~(unsigned)(ECHO | ICANON | ISIG | IEXTEN);
        t.c_cc[VMIN] = 1, t.c_cc[VTIME] = 0;
        tcsetattr(0, TCSAFLUSH, &t);
    }
    fputs("\033[?1049h\033[?25l", stdout);
    int cursor = 0;
    paint(title, cursor);
    for (;;) {
        unsigned char key;
        ssize_t n = read(0, &key, 1);
        if (n < 0 && errno == EINTR) {
            if (resized) resized = 0, paint(title, cursor);
            continue;
        }
        if (n <= 0 || key == 'q') break;
        int old = cursor;
        if (key == 'j' && cursor + 1 < MENU_LEN) cursor++;
        if (key == 'k' && cursor > 0) cursor--;
        if (cursor != old) paint(title, cursor);
    }
    if (tty_in) tcsetattr(0, TCSAFLUSH, &before);
    fputs("\033[?25h\033[?1049l", stdout);
    fflush(stdout);
    return 0;
}
