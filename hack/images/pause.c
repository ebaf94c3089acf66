/* elastrain's pause: PID 1 of a pod sandbox. It holds the pod's namespaces, reaps the orphans the
 * kernel re-parents to it, and exits 0 on SIGINT or SIGTERM. Built by hack/images/pause.py:
 *   gcc -static -Os -s -o pause pause.c                                                         */
#include <errno.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) { (void)sig; _exit(0); }

static void on_child(int sig) {
    int saved = errno;
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {}
    errno = saved;
}

int main(void) {
    struct sigaction stop = {.sa_handler = on_stop};
    struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    if (sigaction(SIGINT, &stop, NULL) || sigaction(SIGTERM, &stop, NULL)
        || sigaction(SIGCHLD, &child, NULL))
        return 1;
    for (;;)
        pause();
}
