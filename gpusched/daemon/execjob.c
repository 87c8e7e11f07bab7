/*
 * gpusched-execjob: the job's child, in C. The shim (shim.py) starts it with posix_spawn, which
 * neither copies the shim's memory nor runs Python after the fork; it becomes the job exactly as
 * shim._child does in a forked Python child (the fallback when this is not built), and then execs it.
 * A fork of the Python shim cost the job's start ~3 ms here (copying and tearing down a Python
 * process's address space, and Python running in the child); this costs well under one.
 *
 *   gpusched-execjob ARG...      (the job's argv, at least one), with an environment of
 *   GPUSCHED_X_CGROUP  the job's cgroup directory, or empty for none
 *   GPUSCHED_X_CPUSET, GPUSCHED_X_GROUPS  comma-separated numbers (may be empty)
 *   GPUSCHED_X_DROP    "1": take the job's user's groups, gid and uid (as root); "0": keep ours
 *   GPUSCHED_X_UID, GPUSCHED_X_GID, GPUSCHED_X_LOG, GPUSCHED_X_CWD
 *   E0, E1, ...        NAME=VALUE: the job's environment, in order
 *
 * Descriptor 3 is the shim's report pipe for a failure: "STAGE: strerror", as shim._child writes
 * it, then exit 127. On success nothing is written and the pipe closes at the job's exec
 * (close-on-exec).
 *
 * The job's environment is never this program's own: it runs as root until it drops privileges,
 * and the dynamic loader would honour a submitter's LD_PRELOAD (or GLIBC_TUNABLES, ...) there. Each
 * variable rides as the value of an E<n>, names the loader ignores, and only the job's execve gets
 * them as they are. Nor is it in argv: /proc/PID/cmdline is anyone's to read, environ only root's.
 *
 * Every step runs in shim._child's order: setsid; join the cgroup (while still root, before
 * anything of the job runs); CPU affinity; setgroups, setgid, setuid; open the log and chdir as the
 * user (so a path the user may not reach fails as it would for them); stdin from /dev/null, stdout
 * and stderr to the log; every ignored signal back to its default (glibc's own two included) and no
 * signal blocked; then the PATH search of Python's os.execvpe (the job's PATH, or /bin:/usr/bin; an
 * empty entry is the working directory; the first error other than ENOENT/ENOTDIR is reported).
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

/* Report "STAGE DETAIL: strerror(errno)" on the report pipe and exit 127, as shim._child does. */
static void fail(const char *stage, const char *detail) {
    char buf[4096];
    int n = snprintf(buf, sizeof buf, "%s%s%s: %s", stage, *detail ? " " : "", detail, strerror(errno));
    if (n > (int)sizeof buf - 1)
        n = (int)sizeof buf - 1;
    if (n > 0) {
        ssize_t ignored = write(REPORT_FD, buf, (size_t)n);
        (void)ignored;
    }
    _exit(127);
}

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

static const char *param(const char *name) {
    const char *value = getenv(name);
    if (value == NULL) {
        errno = EINVAL;
        fail("launch", name);
    }
    return value;
}

/* The value of an entry E<digits>=VALUE, or NULL for any other entry. */
static char *job_variable(char *entry) {
    if (entry[0] != 'E' || entry[1] < '0' || entry[1] > '9')
        return NULL;
    char *p = entry + 1;
    while (*p >= '0' && *p <= '9')
        p++;
    return *p == '=' ? p + 1 : NULL;
}

/* The job's environment: the values of our E<n>, in the order the shim gave them. */
static char **job_environment(void) {
    size_t count = 0;
    for (char **e = environ; *e; e++)
        count += job_variable(*e) != NULL;
    char **out = calloc(count + 1, sizeof *out);
    if (out == NULL)
        fail("launch", "environment");
    size_t i = 0;
    for (char **e = environ; *e; e++) {
        char *value = job_variable(*e);
        if (value != NULL)
            out[i++] = value;
    }
    return out;
}

int main(int argc, char **argv) {
    if (fcntl(REPORT_FD, F_SETFD, FD_CLOEXEC) != 0)
        return 126;  /* no report pipe: not started by the shim */
    if (argc < 2) {
        errno = EINVAL;
        fail("launch", "argv");
    }
    const char *cgroup = param("GPUSCHED_X_CGROUP"), *cpuset = param("GPUSCHED_X_CPUSET");
    const char *drop = param("GPUSCHED_X_DROP"), *uid = param("GPUSCHED_X_UID"), *gid = param("GPUSCHED_X_GID");
    const char *groups = param("GPUSCHED_X_GROUPS"), *log_path = param("GPUSCHED_X_LOG");
    const char *cwd = param("GPUSCHED_X_CWD");
    char **job_argv = argv + 1;  /* with argv's own closing NULL */
    char **job_envp = job_environment();
    if (setsid() < 0)
        fail("setsid", "");
    if (*cgroup)
        join_cgroup(cgroup);
    if (*cpuset)
        set_affinity(cpuset);
    if (strcmp(drop, "1") == 0)
        drop_privileges(uid, gid, groups);
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
    fail("exec", job_argv[0]);
}
