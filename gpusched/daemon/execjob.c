/*
 * gpusched-execjob: the job's child, in C. The shim (shim.py) starts it with posix_spawn, which
 * neither copies the shim's memory nor runs Python after the fork; it becomes the job exactly as
 * shim._child does in a forked Python child (the fallback when this is not built), and then execs it.
 * A fork of the Python shim cost the job's start ~3 ms here (copying and tearing down a Python
 * process's address space, and Python running in the child); this costs well under one.
 *
 *   gpusched-execjob CGROUP CPUSET DROP UID GID GROUPS LOG CWD NARGS ARG... ENV...
 *
 * CGROUP: the job's cgroup directory, or "" for none; CPUSET and GROUPS: comma-separated numbers
 * (may be empty); DROP: "1" to take the job's user's groups, gid and uid (as root), "0" to keep
 * ours; NARGS: how many ARGs (the job's argv, at least one) follow; the rest is the job's
 * environment, NAME=VALUE each. Descriptor 3 is the shim's report pipe for a failure: "STAGE:
 * strerror", as shim._child writes it, then exit 127. On success nothing is written and the pipe
 * closes at the job's exec (close-on-exec).
 *
 * The job's environment is never ours: this program runs as root until it drops privileges, and
 * the dynamic loader would honour a submitter's LD_PRELOAD in its own environment. The shim starts
 * it with an empty one; the job's is handed over in argv and given to the job's execve only.
 *
 * Every step runs in shim._child's order: setsid; join the cgroup (while still root, before
 * anything of the job runs); CPU affinity; setgroups, setgid, setuid; open the log and chdir as the
 * user (so a path the user may not reach fails as it would for them); stdin from /dev/null, stdout
 * and stderr to the log; every ignored signal back to its default (glibc's own two included) and no
 * signal blocked; then the
 * PATH search of Python's os.execvpe (the job's PATH, or /bin:/usr/bin; an empty entry is the
 * working directory; the first error other than ENOENT/ENOTDIR is the one reported).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define REPORT_FD 3
#define MAX_GROUPS 65536

static void report(const char *stage, const char *detail, int err) {
    char buf[4096];
    int n = snprintf(buf, sizeof buf, "%s%s%s: %s", stage, *detail ? " " : "", detail, strerror(err));
    if (n > (int)sizeof buf - 1)
        n = (int)sizeof buf - 1;
    if (n > 0) {
        ssize_t ignored = write(REPORT_FD, buf, (size_t)n);
        (void)ignored;
    }
    _exit(127);
}

static void fail(const char *stage, const char *detail) { report(stage, detail, errno); }

/* Parse "1,2,3" into out (at most cap numbers); returns the count, or -1 on a malformed list. */
static long parse_list(const char *text, unsigned long *out, long cap) {
    long count = 0;
    const char *p = text;
    while (*p) {
        char *end;
        errno = 0;
        unsigned long value = strtoul(p, &end, 10);
        if (end == p || errno || count >= cap || (*end && *end != ','))
            return -1;
        out[count++] = value;
        p = *end ? end + 1 : end;
    }
    return count;
}

static void join_cgroup(const char *cgroup) {
    char path[4096], pid[32];
    if (snprintf(path, sizeof path, "%s/cgroup.procs", cgroup) >= (int)sizeof path) {
        errno = ENAMETOOLONG;
        fail("join cgroup", cgroup);
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);  /* as Python's open(path, "w") */
    if (fd < 0)
        fail("join cgroup", cgroup);
    int n = snprintf(pid, sizeof pid, "%d", (int)getpid());
    if (write(fd, pid, (size_t)n) != n || close(fd) != 0)
        fail("join cgroup", cgroup);
}

static void set_affinity(const char *list) {
    static unsigned long cpus[CPU_SETSIZE];
    long count = parse_list(list, cpus, CPU_SETSIZE);
    if (count < 0) {
        errno = EINVAL;
        fail("set CPU affinity", "");
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    for (long i = 0; i < count; i++) {
        if (cpus[i] >= CPU_SETSIZE) {
            errno = EINVAL;
            fail("set CPU affinity", "");
        }
        CPU_SET(cpus[i], &set);
    }
    if (sched_setaffinity(0, sizeof set, &set) != 0)
        fail("set CPU affinity", "");
}

static void drop_privileges(const char *uid_text, const char *gid_text, const char *groups_text) {
    static unsigned long numbers[MAX_GROUPS];
    static gid_t groups[MAX_GROUPS];
    unsigned long uid, gid;
    long count = parse_list(groups_text, numbers, MAX_GROUPS);
    if (count < 0 || parse_list(uid_text, &uid, 1) != 1 || parse_list(gid_text, &gid, 1) != 1) {
        errno = EINVAL;
        fail("setgroups", "");
    }
    for (long i = 0; i < count; i++)
        groups[i] = (gid_t)numbers[i];
    if (setgroups((size_t)count, groups) != 0)
        fail("setgroups", "");
    if (setgid((gid_t)gid) != 0)
        fail("setgid", "");
    if (setuid((uid_t)uid) != 0)
        fail("setuid", "");
}

/* The kernel's struct sigaction: glibc's sigaction() refuses its own two signals (32 and 33), which
 * its posix_spawn leaves ignored in the child; the Python child never had them ignored. */
struct kernel_sigaction {
    void (*handler)(int);
    unsigned long flags;
    void (*restorer)(void);
    unsigned long mask;
};

static void reset_signals(void) {
    for (int sig = 1; sig < NSIG; sig++) {
        struct kernel_sigaction old, dfl = {SIG_DFL, 0, NULL, 0};
        if (syscall(SYS_rt_sigaction, sig, NULL, &old, sizeof old.mask) == 0 && old.handler == SIG_IGN)
            syscall(SYS_rt_sigaction, sig, &dfl, NULL, sizeof dfl.mask);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
}

/* os.execvpe's search: returns only on failure, with errno the error to report. */
static void exec_search(char **argv, char **envp) {
    const char *file = argv[0];
    if (strchr(file, '/')) {
        execve(file, argv, envp);
        return;
    }
    const char *path = NULL;
    for (char **e = envp; *e; e++) {
        if (strncmp(*e, "PATH=", 5) == 0) {
            path = *e + 5;  /* the first PATH, as Python's dict of the environment keeps */
            break;
        }
    }
    if (path == NULL)
        path = "/bin:/usr/bin";  /* os.defpath */
    int saved = 0, last = ENOENT;
    size_t flen = strlen(file);
    char full[8192];
    for (const char *dir = path;; dir++) {
        const char *end = strchrnul(dir, ':');
        size_t dlen = (size_t)(end - dir);
        if (dlen == 0) {
            execve(file, argv, envp);  /* an empty entry: os.path.join("", file) is file */
        } else if (dlen + 1 + flen < sizeof full) {
            memcpy(full, dir, dlen);
            full[dlen] = '/';
            memcpy(full + dlen + 1, file, flen + 1);
            execve(full, argv, envp);
        } else {
            errno = ENAMETOOLONG;
        }
        last = errno;
        if (last != ENOENT && last != ENOTDIR && saved == 0)
            saved = last;
        if (*end == '\0')
            break;
        dir = end;
    }
    errno = saved ? saved : last;
}

int main(int argc, char **argv) {
    if (fcntl(REPORT_FD, F_SETFD, FD_CLOEXEC) != 0)
        return 126;  /* no report pipe: not started by the shim */
    if (argc < 11) {
        errno = EINVAL;
        fail("launch", "arguments");
    }
    const char *cgroup = argv[1], *cpuset = argv[2], *drop = argv[3];
    const char *log_path = argv[7], *cwd = argv[8];
    char *end;
    errno = 0;
    long nargs = strtol(argv[9], &end, 10);
    if (*end || errno || nargs < 1 || nargs > argc - 10) {
        errno = EINVAL;
        fail("launch", "arguments");
    }
    char **job_argv = calloc((size_t)nargs + 1, sizeof *job_argv);  /* its own closing NULL */
    if (job_argv == NULL)
        fail("launch", "arguments");
    memcpy(job_argv, argv + 10, (size_t)nargs * sizeof *job_argv);
    char **job_envp = argv + 10 + nargs;  /* through argv's closing NULL */
    const char *first = job_argv[0];
    if (setsid() < 0)
        fail("setsid", "");
    if (*cgroup)
        join_cgroup(cgroup);
    if (*cpuset)
        set_affinity(cpuset);
    if (strcmp(drop, "1") == 0)
        drop_privileges(argv[4], argv[5], argv[6]);
    int log_fd = open(log_path, O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (log_fd < 0)
        fail("open log", log_path);
    if (chdir(cwd) != 0)
        fail("chdir", cwd);
    int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null_fd < 0 || dup2(null_fd, 0) < 0 || dup2(log_fd, 1) < 0 || dup2(log_fd, 2) < 0)
        fail("chdir", cwd);  /* (shim._child's stage for these too) */
    reset_signals();
    exec_search(job_argv, job_envp);
    fail("exec", first);
}
