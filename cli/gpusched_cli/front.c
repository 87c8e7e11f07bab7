/* gpusched's front: `gpusched submit` without starting a Python interpreter.
 *
 * Why: a script that submits one job per process waits for the client's start, and Python's own
 * start (15-30 ms here, before any import) is already longer than Slurm's whole `sbatch` (issue 13).
 * So the installed `gpusched` is this program (front_build.py). It does one thing itself, the plain
 * submit, and hands everything else to the Python program, which stays the only authority on
 * messages, exit codes and every other command:
 *
 *   - a command line it does not take whole (another command, help, an option it leaves to Python,
 *     any value it does not accept exactly as the Python parser would, text that is not plain ASCII,
 *     a socket that is missing, foreign or refuses the hello): it execs the Python program with the
 *     same arguments before sending anything (run_python);
 *   - a submit it sent whose answer is not the plain "queued" one (an error, a lost connection, a
 *     reply it does not read), or one it was about to send when the daemon broke the connection
 *     during the hello (killed or restarting): it execs the Python program's `resume` with the very
 *     request, whose request_id lets the daemon recognise a job it already queued, and which waits
 *     out a restarting daemon as `gpusched submit` does after a lost answer (hand_over).
 *
 * What it sends is byte for byte the frame `gpusched submit` sends in Python for the same command
 * line (tests/cli/test_front.py holds the two to each other); what it prints on success is what that
 * prints. GPUSCHED_PYTHON, the interpreter of the installation, is fixed at build time.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#ifndef GPUSCHED_PYTHON
#error "build with -DGPUSCHED_PYTHON='\"/path/to/python\"' (python -m gpusched_cli.front_build does)"
#endif

/* The Python program's two entries: the whole CLI (sys.argv[1:] are gpusched's arguments), and the
 * rest of a submit this front sent (fastpath.resume). -P: no current directory on sys.path. */
#define RUN_CLI "from gpusched_cli.fastpath import main; main()"
#define RUN_RESUME "from gpusched_cli.fastpath import resume; resume()"

/* The protocol's numbers (gpusched/wire.py, gpusched_cli/submitspec.py; test_front.py compares them). */
#define ROOT_SOCKET "/run/gpusched/gpusched.sock"
#define PROTOCOL_VERSION "1.1"
#define MAX_FRAME (1u << 20)
#define MAX_SPEC_BYTES (256u * 1024u)
#define SPEC_STRING_OVERHEAD 9u
#define MAX_NAME 128u
#define MAX_PROFILE 32u
#define MAX_TIME_LIMIT_S (365L * 86400L) /* run_submit.MAX_TIME_LIMIT_S */
#define MAX_MEM_MIB ((1LL << 43) - 1)     /* wire.MAX_MEM_MIB */
#define FIELD_MAX 999999999LL              /* a time's field: more is past 365 days whatever its unit */
#define SIZE_NUMBER_MAX 999999999999999LL  /* a size's number, exact in a double (a larger one is Python's) */
#define TIMEOUT_S 60      /* the Python client's socket timeout */
#define PROBE_TIMEOUT_S 1 /* resolve_socket's probe of a default socket */
#define EXIT_ERROR 1
#define EXIT_ABORTED 1           /* click's, after Ctrl-C */
#define EXIT_OUTPUT_CLOSED 141   /* 128 + SIGPIPE, as the Python program exits */
#define HELLO_BROKE (-2)         /* connect_daemon: the daemon accepted the connection, then broke it */

static int g_argc;
static char **g_argv;

/* ---- handing over to Python --------------------------------------------------------------------- */

static void python_missing(void) {
    /* Only a broken installation gets here (the interpreter it was built for is gone). */
    dprintf(2, "error: cannot run %s: %s\nhint: reinstall gpusched (or run `python -m gpusched_cli.front_build` "
               "with the installation's Python)\n", GPUSCHED_PYTHON, strerror(errno));
    _exit(EXIT_ERROR);
}

/* Everything this front does not take whole: the Python program, from the start, with the same argv. */
static void run_python(void) {
    char **args = calloc((size_t)g_argc + 4, sizeof *args);
    if (args == NULL)
        python_missing();
    args[0] = GPUSCHED_PYTHON;
    args[1] = "-P";
    args[2] = "-c";
    args[3] = RUN_CLI;
    for (int i = 1; i < g_argc; i++)
        args[3 + i] = g_argv[i];
    execv(GPUSCHED_PYTHON, args);
    python_missing();
}

/* A submit that was sent and not plainly answered: Python carries on with this very request (the same
 * request_id), sending it again as `gpusched submit` does after a lost connection, and reports whatever
 * comes back in its own words. The request travels in a memfd, whatever its size. */
static void hand_over(const char *path, const char *frame, size_t len, bool as_json) {
    int fd = memfd_create("gpusched-submit", 0); /* inherited by the exec on purpose */
    size_t done = 0;
    while (fd >= 0 && done < len) {
        ssize_t n = write(fd, frame + done, len - done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            close(fd);
            fd = -1;
        } else {
            done += (size_t)n;
        }
    }
    if (fd < 0 || lseek(fd, 0, SEEK_SET) != 0) {
        dprintf(2, "error: the connection to gpuschedd broke during the submit, and it cannot be handed on: %s\n"
                   "hint: `gpusched queue` shows whether the job was queued\n", strerror(errno));
        _exit(EXIT_ERROR);
    }
    char fd_text[16];
    snprintf(fd_text, sizeof fd_text, "%d", fd);
    char *args[] = {GPUSCHED_PYTHON, "-P", "-c", RUN_RESUME, (char *)path, fd_text, as_json ? "1" : "0", NULL};
    execv(GPUSCHED_PYTHON, args);
    python_missing();
}

static void on_interrupt(int sig) {
    (void)sig;
    static const char aborted[] = "\nAborted!\n"; /* what the Python program says after Ctrl-C */
    (void)!write(2, aborted, sizeof aborted - 1);
    _exit(EXIT_ABORTED);
}

/* ---- text ---------------------------------------------------------------------------------------- */

/* Plain ASCII: Python reads other bytes through the locale's codec (and refuses what is not text), so
 * such a command line goes to it. */
static bool is_ascii(const char *s) {
    for (; *s; s++)
        if ((unsigned char)*s >= 0x80)
            return false;
    return true;
}

/* ASCII digits at *p into *out, stopping at the first other character; false if there are none or
 * their value passes `most` (which also keeps every sum below from overflowing). Leading zeros are
 * taken, as Python's int() takes them. */
static bool digits(const char **p, long long most, long long *out) {
    long long value = 0;
    const char *start = *p;
    for (; **p >= '0' && **p <= '9'; (*p)++) {
        value = value * 10 + (**p - '0');
        if (value > most)
            return false;
    }
    *out = value;
    return *p != start;
}

/* The digits of an INT option as options.Option.value reads them: ASCII digits only, in [low, high]. */
static bool parse_int(const char *text, long low, long high, long *out) {
    long long value;
    if (!digits(&text, high, &value) || *text != '\0' || value < low)
        return false;
    *out = (long)value;
    return true;
}

/* run_submit.mig_profile's ^[0-9]+g\.[0-9]+gb(\+me)?$ (a trailing newline, which `$` lets through, is
 * left to Python). */
static bool is_mig_profile(const char *s) {
    const char *p = s;
    if (*p < '0' || *p > '9')
        return false;
    while (*p >= '0' && *p <= '9')
        p++;
    if (strncmp(p, "g.", 2) != 0)
        return false;
    p += 2;
    if (*p < '0' || *p > '9')
        return false;
    while (*p >= '0' && *p <= '9')
        p++;
    return strcmp(p, "gb") == 0 || strcmp(p, "gb+me") == 0;
}

/* parse.parse_duration_s's suffix form: `30s`, `5m`, `2h`, `1d`, combined in that order, each once,
 * either case. */
static bool parse_suffixed(const char *p, long long *total) {
    static const char units[] = "dhms";
    static const long long unit_s[] = {86400, 3600, 60, 1};
    int next = 0; /* the first unit still allowed */
    long long value;
    *total = 0;
    if (*p == '\0')
        return false;
    while (*p) {
        if (!digits(&p, FIELD_MAX, &value) || *p == '\0')
            return false;
        const char *unit = memchr(units + next, *p | 0x20, sizeof units - 1 - (size_t)next);
        if (unit == NULL)
            return false;
        next = (int)(unit - units) + 1;
        *total += value * unit_s[unit - units];
        p++;
    }
    return true;
}

/* parse.parse_duration_s and run_submit.time_limit, for text without blanks: the suffix form, else
 * Slurm's M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; over zero and at most 365 days. Anything else (blanks,
 * the newline `$` lets through, a refusal to word) is Python's. */
static bool parse_duration(const char *text, long long *seconds) {
    long long total;
    if (!parse_suffixed(text, &total)) {
        const char *p = text;
        long long fields[3] = {0, 0, 0}, days = -1;
        int n = 0;
        if (!digits(&p, FIELD_MAX, &fields[0]))
            return false;
        if (*p == '-') {
            days = fields[0];
            p++;
            if (!digits(&p, FIELD_MAX, &fields[0]))
                return false;
        }
        n = 1;
        while (*p == ':' && n < 3) {
            p++;
            if (!digits(&p, FIELD_MAX, &fields[n++]))
                return false;
        }
        if (*p != '\0')
            return false;
        if (days >= 0)
            total = ((days * 24 + fields[0]) * 60 + fields[1]) * 60 + fields[2]; /* D-H[:M[:S]] */
        else if (n == 3)
            total = (fields[0] * 60 + fields[1]) * 60 + fields[2]; /* H:M:S */
        else
            total = fields[0] * 60 + fields[1]; /* M[:S] */
    }
    if (total <= 0 || total > MAX_TIME_LIMIT_S)
        return false;
    *seconds = total;
    return true;
}

/* parse.parse_size_mib for a whole number with an optional unit K, M, G or T (B or iB after it, either
 * case): MiB, rounded up, at least 1, at most wire.MAX_MEM_MIB; the same double arithmetic as Python's.
 * A fraction, blanks or anything else is Python's. */
static bool parse_size_mib(const char *text, long long *mib) {
    const char *p = text;
    long long number;
    if (!digits(&p, SIZE_NUMBER_MAX, &number))
        return false;
    double scale = 1.0;
    if (*p != '\0') {
        switch (*p | 0x20) {
        case 'k': scale = 1.0 / 1024.0; break;
        case 'm': scale = 1.0; break;
        case 'g': scale = 1024.0; break;
        case 't': scale = 1024.0 * 1024.0; break;
        default: return false;
        }
        p++;
        if ((*p | 0x20) == 'i' && (p[1] | 0x20) == 'b')
            p += 2;
        else if ((*p | 0x20) == 'b')
            p++;
    }
    double value = (double)number * scale;
    if (*p != '\0' || value <= 0 || value > (double)MAX_MEM_MIB)
        return false;
    double forgiven = value - 1e-9; /* math.ceil(mib - 1e-9): positive here, so ceil is truncate-and-step */
    long long up = (long long)forgiven;
    if ((double)up < forgiven)
        up++;
    *mib = up < 1 ? 1 : up;
    return *mib <= MAX_MEM_MIB;
}

/* Not empty once Python's str.strip() has taken the ASCII whitespace off (run_submit.prepare). */
static bool has_visible(const char *s) {
    for (; *s; s++)
        if (!strchr(" \t\n\r\v\f\x1c\x1d\x1e\x1f", *s))
            return true;
    return false;
}

static bool one_of(const char *value, const char *const *choices) {
    for (; *choices; choices++)
        if (strcmp(value, *choices) == 0)
            return true;
    return false;
}

/* ---- the frame ----------------------------------------------------------------------------------- */

typedef struct {
    char *data;
    size_t len, cap;
    bool failed; /* out of memory: the command line goes to Python */
} Buf;

static void put_n(Buf *b, const char *s, size_t n) {
    if (b->failed)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *data = realloc(b->data, cap);
        if (data == NULL) {
            b->failed = true;
            return;
        }
        b->data = data;
        b->cap = cap;
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

static void put(Buf *b, const char *s) { put_n(b, s, strlen(s)); }

static void put_long(Buf *b, long long value) {
    char text[24];
    put_n(b, text, (size_t)snprintf(text, sizeof text, "%lld", value));
}

/* An optional number: `value` then `suffix` (".0" for a float: Python's repr of a whole one, 300.0),
 * or null where it was not given (0). */
static void put_number_or_null(Buf *b, long long value, const char *suffix) {
    if (value == 0) {
        put(b, "null");
        return;
    }
    put_long(b, value);
    put(b, suffix);
}

/* A JSON string as Python's json.dumps(ensure_ascii=False) writes an ASCII one: the same escapes. */
static void put_json_n(Buf *b, const char *s, size_t n) {
    put(b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *short_form = c == '"' ? "\\\"" : c == '\\' ? "\\\\" : c == '\n' ? "\\n" : c == '\r' ? "\\r"
                                 : c == '\t' ? "\\t" : c == '\b' ? "\\b" : c == '\f' ? "\\f" : NULL;
        if (short_form != NULL) {
            put(b, short_form);
        } else if (c < 0x20) {
            char esc[8];
            snprintf(esc, sizeof esc, "\\u%04x", c);
            put(b, esc);
        } else {
            put_n(b, (const char *)&s[i], 1);
        }
    }
    put(b, "\"");
}

static void put_json(Buf *b, const char *s) { put_json_n(b, s, strlen(s)); }

static void put_json_or_null(Buf *b, const char *s) {
    if (s == NULL)
        put(b, "null");
    else
        put_json(b, s);
}

/* ---- the command line ---------------------------------------------------------------------------- */

typedef struct {
    const char *socket;
    long gpus; /* 0: not given */
    const char *mig, *name, *job_class, *precision, *export_;
    long nice, cpus; /* cpus 0: not given */
    long long time_limit_s, mem_mib; /* 0: not given */
    bool requeue, hold, as_json;
    char **command;
    int ncommand;
} Submit;

enum { O_GPUS, O_MIG, O_NAME, O_TIME, O_CLASS, O_NICE, O_REQUEUE, O_CPUS, O_MEM, O_HOLD, O_EXPORT, O_PRECISION, O_JSON,
       O_OTHER };

/* SUBMIT's options (run_submit.py). Those marked O_OTHER (--partition, --share, --gpu-mem, --after,
 * --array, --wait) are Python's: a command line with one goes to it whole. */
static const struct {
    const char *flag;
    int id;
    bool is_flag;
} OPTIONS[] = {
    {"--gpus", O_GPUS, false},       {"--mig", O_MIG, false},         {"--name", O_NAME, false},
    {"--class", O_CLASS, false},     {"--nice", O_NICE, false},       {"--requeue", O_REQUEUE, true},
    {"--cpus", O_CPUS, false},       {"--hold", O_HOLD, true},        {"--export", O_EXPORT, false},
    {"--precision", O_PRECISION, false}, {"--json", O_JSON, true},    {"--partition", O_OTHER, false},
    {"--share", O_OTHER, false},     {"--gpu-mem", O_OTHER, false},   {"--time", O_TIME, false},
    {"--after", O_OTHER, false},     {"--mem", O_MEM, false},         {"--array", O_OTHER, false},
    {"--wait", O_OTHER, true},
};

/* fastpath.parse and options.Command.parse for `[--socket PATH] submit ...`, narrowed to what this
 * front sends itself; false sends the command line to Python. */
static bool parse(int argc, char **argv, Submit *s) {
    static const char *const classes[] = {"batch", "interactive", NULL};
    static const char *const precisions[] = {"fp16", "bf16", "fp32", "tf32", NULL};
    const char *values[O_OTHER] = {0};
    bool seen[O_OTHER] = {0};
    int i = 1;
    memset(s, 0, sizeof *s);
    while (i < argc && strncmp(argv[i], "--socket", 8) == 0) {
        const char *eq = strchr(argv[i], '=');
        if ((eq ? (size_t)(eq - argv[i]) : strlen(argv[i])) != 8 || s->socket != NULL)
            return false;
        if (eq == NULL) {
            if (i + 1 >= argc || argv[i + 1][0] == '-')
                return false;
            s->socket = argv[++i];
        } else {
            s->socket = eq + 1;
        }
        i++;
    }
    if (i >= argc || strcmp(argv[i], "submit") != 0)
        return false;
    i++;
    while (i < argc) {
        const char *arg = argv[i++];
        if (strcmp(arg, "--") == 0) {
            s->command = &argv[i];
            s->ncommand = argc - i;
            break;
        }
        if (arg[0] != '-' || strcmp(arg, "-") == 0) {
            s->command = &argv[i - 1];
            s->ncommand = argc - i + 1;
            break;
        }
        const char *eq = strncmp(arg, "--", 2) == 0 ? strchr(arg, '=') : NULL;
        size_t name_len = eq ? (size_t)(eq - arg) : strlen(arg);
        int id = -1;
        bool is_flag = false;
        for (size_t k = 0; k < sizeof OPTIONS / sizeof *OPTIONS; k++) {
            if (strlen(OPTIONS[k].flag) == name_len && strncmp(OPTIONS[k].flag, arg, name_len) == 0) {
                id = OPTIONS[k].id;
                is_flag = OPTIONS[k].is_flag;
            }
        }
        if (id < 0 || id == O_OTHER)
            return false; /* unknown (help, a typo, a short flag), or Python's */
        if (is_flag) {
            if (eq != NULL)
                return false;
            seen[id] = true;
            continue;
        }
        const char *value;
        if (eq != NULL)
            value = eq + 1;
        else if (i < argc && argv[i][0] != '-')
            value = argv[i++];
        else
            return false;
        if (seen[id])
            return false; /* a repeated option: Python's call */
        seen[id] = true;
        values[id] = value;
    }
    if (s->ncommand == 0)
        return false;
    if (seen[O_GPUS] && !parse_int(values[O_GPUS], 1, 64, &s->gpus))
        return false;
    if (seen[O_MIG] && !is_mig_profile(values[O_MIG]))
        return false;
    s->mig = values[O_MIG];
    s->name = values[O_NAME];
    s->job_class = seen[O_CLASS] ? values[O_CLASS] : "batch";
    if (!one_of(s->job_class, classes))
        return false;
    if (seen[O_NICE] && !parse_int(values[O_NICE], 0, 19, &s->nice))
        return false;
    if (seen[O_CPUS] && !parse_int(values[O_CPUS], 1, 4096, &s->cpus))
        return false;
    if (seen[O_TIME] && !parse_duration(values[O_TIME], &s->time_limit_s))
        return false;
    if (seen[O_MEM] && !parse_size_mib(values[O_MEM], &s->mem_mib))
        return false;
    s->precision = values[O_PRECISION];
    if (s->precision != NULL && !one_of(s->precision, precisions))
        return false;
    s->export_ = seen[O_EXPORT] ? values[O_EXPORT] : "ALL";
    s->requeue = seen[O_REQUEUE];
    s->hold = seen[O_HOLD];
    s->as_json = seen[O_JSON];
    return true;
}

/* ---- the request (run_submit.prepare, messages.job_spec, messages.submit) ----------------------- */

extern char **environ;

/* The whole environment (`--export ALL`) as a JSON object, in its order. A variable Python would read
 * otherwise (no `=`, an empty name, a name given twice, non-ASCII) sends the command line to Python. */
static bool put_environment(Buf *b, size_t *bound) {
    put(b, "{");
    for (char **e = environ; *e; e++) {
        const char *eq = strchr(*e, '=');
        if (eq == NULL || eq == *e || !is_ascii(*e))
            return false;
        size_t key_len = (size_t)(eq - *e);
        for (char **prior = environ; prior != e; prior++)
            if (strncmp(*prior, *e, key_len + 1) == 0)
                return false;
        if (e != environ)
            put(b, ",");
        put_json_n(b, *e, key_len);
        put(b, ":");
        put_json(b, eq + 1);
        *bound += 4 * strlen(*e) + SPEC_STRING_OVERHEAD;
    }
    put(b, "}");
    return true;
}

/* The submit frame's body, or false where Python must judge the request (it would refuse it, or the
 * model has to look at it: submitspec.might_be_invalid). */
static bool build_request(const Submit *s, Buf *b) {
    if ((s->gpus != 0) == (s->mig != NULL) || strcmp(s->export_, "ALL") != 0 || !has_visible(s->command[0]))
        return false;
    if ((s->name != NULL && (strlen(s->name) > MAX_NAME || !is_ascii(s->name))) ||
        (s->mig != NULL && strlen(s->mig) > MAX_PROFILE))
        return false;
    char *cwd = getcwd(NULL, 0);
    if (cwd == NULL || !is_ascii(cwd))
        return false;
    size_t bound = 4 * strlen(cwd) + SPEC_STRING_OVERHEAD; /* might_be_invalid's upper bound of the spec */
    put(b, "{\"op\":\"submit\",\"spec\":{\"argv\":[");
    for (int i = 0; i < s->ncommand; i++) {
        if (!is_ascii(s->command[i]))
            return false;
        if (i > 0)
            put(b, ",");
        put_json(b, s->command[i]);
        bound += 4 * strlen(s->command[i]) + SPEC_STRING_OVERHEAD;
    }
    put(b, "],\"cwd\":");
    put_json(b, cwd);
    free(cwd);
    put(b, ",\"env\":");
    if (!put_environment(b, &bound))
        return false;
    if (s->gpus != 0) {
        put(b, ",\"request\":{\"kind\":\"whole\",\"gpus\":");
        put_long(b, s->gpus);
    } else {
        put(b, ",\"request\":{\"kind\":\"mig\",\"profile\":");
        put_json(b, s->mig);
    }
    put(b, "},\"name\":");
    put_json_or_null(b, s->name);
    if (s->name != NULL)
        bound += 4 * strlen(s->name) + SPEC_STRING_OVERHEAD;
    put(b, ",\"time_limit_s\":");
    put_number_or_null(b, s->time_limit_s, ".0"); /* a float on the wire */
    put(b, ",\"job_class\":");
    put_json(b, s->job_class);
    put(b, ",\"nice\":");
    put_long(b, s->nice);
    put(b, s->requeue ? ",\"requeue\":true" : ",\"requeue\":false");
    put(b, ",\"precision\":");
    put_json_or_null(b, s->precision);
    put(b, ",\"after\":[],\"cpus\":");
    put_number_or_null(b, s->cpus, "");
    put(b, ",\"mem_mib\":");
    put_number_or_null(b, s->mem_mib, "");
    put(b, "},\"hold\":");
    put(b, s->hold ? "true" : "false");
    /* resubmit.new_request_id: the time in nanoseconds, then 64 random bits, in 32 hex digits (keys
     * in the order they were made are cheap for the daemon's index of them) */
    struct timespec now;
    unsigned char id[8];
    if (clock_gettime(CLOCK_REALTIME, &now) != 0 || getrandom(id, sizeof id, 0) != (ssize_t)sizeof id)
        return false;
    char hex[33];
    snprintf(hex, 17, "%016llx", (unsigned long long)now.tv_sec * 1000000000ULL + (unsigned long long)now.tv_nsec);
    for (size_t i = 0; i < sizeof id; i++)
        snprintf(hex + 16 + 2 * i, 3, "%02x", id[i]);
    put(b, ",\"request_id\":\"");
    put(b, hex);
    put(b, "\"}");
    return !b->failed && bound <= MAX_SPEC_BYTES && b->len <= MAX_FRAME;
}

/* ---- the socket (client.py) ---------------------------------------------------------------------- */

static bool trusted(uid_t uid) { return uid == 0 || uid == getuid(); }

static int open_socket(const char *path, int timeout_s) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path)
        return -1;
    strcpy(addr.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct timeval tv = {.tv_sec = timeout_s};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static bool exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

/* resolve_socket: --socket, else $GPUSCHED_SOCKET, else the first default socket that accepts a
 * connection (none: NULL, and Python says where it looked). */
static const char *resolve_socket(const char *explicit_, char *user, size_t user_size) {
    if (explicit_ != NULL && *explicit_)
        return explicit_;
    const char *env = getenv("GPUSCHED_SOCKET");
    if (env != NULL && *env)
        return env;
    const char *runtime = getenv("XDG_RUNTIME_DIR");
    char fallback[64];
    snprintf(fallback, sizeof fallback, "/tmp/gpusched-%u/gpusched.sock", (unsigned)getuid());
    if (runtime != NULL && *runtime) {
        size_t n = strlen(runtime);
        if ((size_t)snprintf(user, user_size, "%s%sgpusched/gpusched.sock", runtime,
                             runtime[n - 1] == '/' ? "" : "/") >= user_size)
            return NULL;
    } else {
        snprintf(user, user_size, "%s", fallback);
    }
    const char *candidates[] = {ROOT_SOCKET, user, strcmp(fallback, user) == 0 ? NULL : fallback};
    for (size_t i = 0; i < 3; i++) {
        if (candidates[i] == NULL || !exists(candidates[i]))
            continue;
        int probe = open_socket(candidates[i], PROBE_TIMEOUT_S);
        if (probe >= 0) {
            close(probe);
            return candidates[i] == fallback ? strcpy(user, fallback) : candidates[i];
        }
    }
    return NULL;
}

/* check_socket_owner and check_daemon_identity: the socket, its directory and the process listening
 * belong to root or to the caller (a submit carries the whole environment). */
static bool owner_trusted(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0)
        return true; /* missing or unreachable: connect says so */
    if (!trusted(st.st_uid))
        return false;
    char *real = realpath(path, NULL);
    if (real == NULL)
        return false;
    char *slash = strrchr(real, '/');
    if (slash == real)
        slash[1] = '\0';
    else if (slash != NULL)
        *slash = '\0';
    bool ok = stat(real, &st) == 0 && trusted(st.st_uid);
    free(real);
    return ok;
}

static bool peer_trusted(int fd) {
    struct ucred cred;
    socklen_t len = sizeof cred;
    return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && trusted(cred.uid);
}

/* All of `len` bytes out (`sending`) or in, through EINTR and short transfers; false on an error or
 * the end of the connection. */
static bool transfer(int fd, char *data, size_t len, bool sending) {
    while (len > 0) {
        ssize_t n = sending ? send(fd, data, len, MSG_NOSIGNAL) : recv(fd, data, len, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return false;
        data += n;
        len -= (size_t)n;
    }
    return true;
}

/* One frame out (a 4-byte big-endian length, then the JSON) and the reply's body in (NUL-terminated). */
static char *call(int fd, const char *body, size_t len) {
    unsigned char header[4] = {(unsigned char)(len >> 24), (unsigned char)(len >> 16), (unsigned char)(len >> 8),
                               (unsigned char)len};
    if (!transfer(fd, (char *)header, 4, true) || !transfer(fd, (char *)body, len, true) ||
        !transfer(fd, (char *)header, 4, false))
        return NULL;
    uint32_t n = (uint32_t)header[0] << 24 | (uint32_t)header[1] << 16 | (uint32_t)header[2] << 8 | header[3];
    if (n == 0 || n > MAX_FRAME)
        return NULL;
    char *reply = malloc((size_t)n + 1);
    if (reply == NULL || !transfer(fd, reply, n, false)) {
        free(reply);
        return NULL;
    }
    reply[n] = '\0';
    return reply;
}

/* ---- reading a reply: just enough JSON for `{"ok":true,"result":{...}}` ------------------------- */

static const char *skip_ws(const char *p) {
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    return p;
}

/* Past one JSON value; NULL if it is not one. */
static const char *skip_value(const char *p, int depth) {
    p = skip_ws(p);
    if (depth > 64)
        return NULL;
    if (*p == '"') {
        for (p++; *p != '"'; p++) {
            if (*p == '\0' || (unsigned char)*p < 0x20)
                return NULL;
            if (*p == '\\' && *++p == '\0')
                return NULL;
        }
        return p + 1;
    }
    if (*p == '{' || *p == '[') {
        char close = *p == '{' ? '}' : ']';
        p = skip_ws(p + 1);
        if (*p == close)
            return p + 1;
        for (;;) {
            if (close == '}') {
                if (*p != '"' || (p = skip_value(p, depth + 1)) == NULL || *(p = skip_ws(p)) != ':')
                    return NULL;
                p++;
            }
            if ((p = skip_value(p, depth + 1)) == NULL)
                return NULL;
            p = skip_ws(p);
            if (*p == close)
                return p + 1;
            if (*p != ',')
                return NULL;
            p = skip_ws(p + 1);
        }
    }
    const char *start = p;
    while (*p && strchr("-+.0123456789eEtruefalsn", *p))
        p++;
    return p == start ? NULL : p;
}

/* The value of `key` in the object at `object` (which must be one), or NULL. A key given twice is
 * not read here (Python keeps the last): NULL too. */
static const char *member(const char *object, const char *key) {
    if (object == NULL)
        return NULL;
    const char *p = skip_ws(object), *found = NULL;
    size_t key_len = strlen(key);
    if (*p != '{' || skip_value(p, 0) == NULL)
        return NULL;
    p = skip_ws(p + 1);
    while (*p == '"') {
        const char *end = skip_value(p, 1);
        bool match = (size_t)(end - p) == key_len + 2 && strncmp(p + 1, key, key_len) == 0;
        p = skip_ws(skip_ws(end) + 1); /* past the ':' */
        if (match) {
            if (found != NULL)
                return NULL;
            found = p;
        }
        p = skip_ws(skip_value(p, 1));
        if (*p == ',')
            p = skip_ws(p + 1);
    }
    return found;
}

static bool is_literal(const char *value, const char *literal) {
    size_t n = strlen(literal);
    return value != NULL && strncmp(value, literal, n) == 0 && skip_value(value, 0) == value + n;
}

/* A plain string's text (no escapes; letters, digits and `_.-`), copied into out; false otherwise. */
static bool plain_string(const char *value, char *out, size_t size) {
    if (value == NULL || *value != '"')
        return false;
    size_t n = 0;
    for (const char *p = value + 1; *p != '"'; p++, n++) {
        if (n + 1 >= size || !(*p == '_' || *p == '.' || *p == '-' || (*p >= '0' && *p <= '9') ||
                                ((*p | 0x20) >= 'a' && (*p | 0x20) <= 'z')))
            return false;
        out[n] = *p;
    }
    out[n] = '\0';
    return true;
}

/* `{"ok": true, "result": {...}}`: the result object, or NULL for anything else. */
static const char *ok_result(const char *reply) {
    const char *result = member(reply, "result");
    return is_literal(member(reply, "ok"), "true") && result != NULL && *result == '{' ? result
                                                                                                        : NULL;
}

/* connect, check whose socket it is, hello; -1 where Python must take over (before anything is sent). */
static int connect_daemon(const char *path) {
    if (!owner_trusted(path))
        return -1;
    int fd = open_socket(path, TIMEOUT_S);
    if (fd < 0)
        return -1;
    if (!peer_trusted(fd)) {
        close(fd);
        return -1;
    }
    static const char hello[] = "{\"op\":\"hello\",\"version\":\"" PROTOCOL_VERSION "\",\"client\":\"gpusched-cli\"}";
    char *reply = call(fd, hello, sizeof hello - 1);
    if (reply == NULL) { /* accepted, then broken: a daemon killed or restarting during the hello */
        close(fd);
        return HELLO_BROKE;
    }
    char version[16];
    /* a 1.0 daemon takes no request_id (resubmit.submit sends it once, without): Python's case */
    bool ok = plain_string(member(ok_result(reply), "version"), version, sizeof version) &&
              strcmp(version, "1.0") != 0;
    free(reply);
    if (!ok) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Print the line of a queued job (run_submit.send), or exit as the Python program does when stdout
 * cannot take it. */
static void print_submitted(const char *job_id, const char *state, bool as_json) {
    char line[160];
    int n = as_json ? snprintf(line, sizeof line, "{\"job_id\":%s,\"state\":\"%s\"}\n", job_id, state)
                    : snprintf(line, sizeof line, "Submitted job %s\n", job_id);
    for (int done = 0; done < n;) {
        ssize_t w = write(1, line + done, (size_t)(n - done));
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0) {
            if (errno == EPIPE)
                _exit(EXIT_OUTPUT_CLOSED); /* quietly, as a C tool that SIGPIPE ends */
            dprintf(2, "error: cannot write the output: %s\n", strerror(errno));
            _exit(EXIT_ERROR);
        }
        done += (int)w;
    }
}

int main(int argc, char **argv) {
    g_argc = argc;
    g_argv = argv;
    signal(SIGINT, on_interrupt); /* exec gives Python back the default */
    Submit s;
    Buf frame = {0};
    char user_socket[PATH_MAX];
    if (getenv("_GPUSCHED_COMPLETE") != NULL || !parse(argc, argv, &s) || !build_request(&s, &frame))
        run_python();
    const char *path = resolve_socket(s.socket, user_socket, sizeof user_socket);
    int fd = path == NULL ? -1 : connect_daemon(path);
    if (fd == HELLO_BROKE) /* nothing was sent; Python sends it, waiting out a restart as after a lost answer */
        hand_over(path, frame.data, frame.len, s.as_json);
    if (fd < 0)
        run_python();
    signal(SIGPIPE, SIG_IGN); /* a closed stdout is an EPIPE to report, as in Python */
    /* From here the request may be queued: whatever is not the plain answer goes to resume. */
    char *reply = call(fd, frame.data, frame.len);
    const char *result = ok_result(reply);
    const char *tasks = member(result, "tasks"), *job_id = member(result, "job_id");
    char state[64], digits[24];
    size_t id_len = job_id == NULL ? 0 : strspn(job_id, "0123456789");
    bool plain = plain_string(member(result, "state"), state, sizeof state) &&
                 (tasks == NULL || is_literal(tasks, "null")) && id_len > 0 && id_len < sizeof digits &&
                 (job_id[0] != '0' || id_len == 1) && skip_value(job_id, 0) == job_id + id_len;
    if (!plain)
        hand_over(path, frame.data, frame.len, s.as_json);
    memcpy(digits, job_id, id_len);
    digits[id_len] = '\0';
    print_submitted(digits, state, s.as_json);
    close(fd);
    return 0;
}
