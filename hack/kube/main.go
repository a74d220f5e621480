// Command kube is one binary that behaves as kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
// or etcd, chosen by the name it is invoked as (argv[0], usually through a symlink) or by its first argument.
// One binary keeps the build to a single link of the shared Kubernetes dependency graph.
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	kubectlcmd "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

var tools = []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "etcd"}

func main() {
	name := filepath.Base(os.Args[0])
	args := os.Args
	if !known(name) && len(os.Args) > 1 && known(os.Args[1]) {
		name, args = os.Args[1], os.Args[1:]
		os.Args = args
	}
	switch name {
	case "kube-apiserver":
		os.Exit(cli.Run(apiserver.NewAPIServerCommand()))
	case "kube-controller-manager":
		os.Exit(cli.Run(controllermanager.NewControllerManagerCommand()))
	case "kube-scheduler":
		os.Exit(cli.Run(scheduler.NewSchedulerCommand()))
	case "kubectl":
		// kubectl prints its own errors (with the right exit code) through CheckErr, as its upstream main does.
		if err := cli.RunNoErrOutput(kubectlcmd.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err)
		}
	case "etcd":
		etcdmain.Main(args)
	default:
		fmt.Fprintf(os.Stderr, "usage: kube {%v} [args...] (or invoke through a symlink of that name)\n", tools)
		os.Exit(2)
	}
}

func known(name string) bool {
	for _, t := range tools {
		if t == name {
			return true
		}
	}
	return false
}
